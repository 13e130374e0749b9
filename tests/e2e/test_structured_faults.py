"""Constrained requests survive preemption and a worker restart (the real model, fp32).

`conveyor up` with the real worker and a KV pool too small for the batch (8 MiB: ~180 tokens
for 8 requests of ~60): constrained requests are preempted and recomputed, and their worker
rebuilds each matcher from the token history; every reply validates against its schema. Then
the same requests again, and the worker is killed (SIGKILL) once every stream has its first
chunk: `up` restarts it, the scheduler replays them on it (some were preempted before: the
scheduler's own bookkeeping of that must not outlive the old worker), and the new worker's
matchers are rebuilt the same way: the replies are the first run's, token for token.
Rough runtime: 60-120 s on the shared 2-core machine (two model loads, ~40 decode steps x 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.structured_schemas import CASES
from shared.client import AsyncClient, Client
from tests.e2e.stack_tools import descendants, start_up
from tests.e2e.test_engine_faults import _stop

pytestmark = pytest.mark.e2e

NAMES = ("person", "rgb", "scores", "event", "sentiment", "nested_address", "city", "matrix")
WAIT_S = 900.0
MAX_TOKENS = 96  # room for each of these schemas' longest reply


def _requests() -> list[tuple[Any, dict[str, Any]]]:
    out = []
    for i, name in enumerate(NAMES):
        case = next(c for c in CASES if c.name == name)
        sampled = i % 2 == 1
        params = dict(max_tokens=MAX_TOKENS, temperature=0.7 if sampled else 0.0,
                      seed=i if sampled else None, json_schema=case.schema)  # fmt: skip
        out.append((case, params))
    return out


async def _run(address: str, kill_pid: int | None) -> list[list[int]]:
    """Every request's token ids; with `kill_pid`, SIGKILL it once each stream has a chunk."""
    async with AsyncClient(address, timeout=WAIT_S) as client:
        started = [asyncio.Event() for _ in NAMES]

        async def one(i: int, case: Any, params: dict[str, Any]) -> list[int]:
            msgs = [{"role": "user", "content": case.prompt}]
            ids: list[int] = []
            async for chunk in client.stream(messages=msgs, **params):
                ids += chunk.token_ids
                started[i].set()
            return ids

        tasks = [asyncio.create_task(one(i, *r)) for i, r in enumerate(_requests())]
        if kill_pid is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
            os.kill(kill_pid, signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))


def test_constrained_requests_survive_preemption_and_a_worker_restart(tmp_path: Path) -> None:
    small_pool = ["--kv-cache-memory", str(8 << 20), "--max-model-len", "160"]
    up, address = start_up(tmp_path, *small_pool, worker="model")
    try:
        undisturbed = asyncio.run(_run(address, None))
        with Client(address, timeout=30.0) as c:
            assert c.stats()["engine"]["num_preemptions"] > 0  # the pool was too small
        worker = next(p for p, cmd in descendants(up.proc.pid).items()
                      if "services.worker" in cmd)  # fmt: skip
        restarted = asyncio.run(_run(address, worker))
        assert restarted == undisturbed  # matchers rebuilt from the history: the same tokens
        log = (tmp_path / "logs" / "scheduler.log").read_text()
        assert '"event":"worker_lost"' in log
    finally:
        _stop(up)
    from tokenizers import Tokenizer

    from shared.model_files import prepare_model

    tok = Tokenizer.from_file(str(prepare_model(None) / "tokenizer.json"))
    for (case, _), ids in zip(_requests(), undisturbed, strict=True):
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), case.schema)
