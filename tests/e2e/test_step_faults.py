"""A failed step fails only the request it is pinned on (issue 14; bisection in
services/scheduler/faults.py), on a real stack: tokenizer, scheduler and a SIMULATED worker
started with `--sim-fail-token` (services/worker/sim/faults.py: every step holding a request
whose prompt contains that token fails, as a worker fails on an input that breaks it).

Nine streams at once, four running slots: one poisoned prompt, eight innocent ones; the
poisoned one waits, then starts in a step with innocent ones (and more wait behind it). The
poisoned stream ends `worker_failed`; every innocent stream ends normally with exactly the
tokens it gets alone (recomputed, no chunk lost or duplicated); the first failed step held
several requests and failed none of them (bisection); the worker is told to drop the failed
request's state; no KV block is left in use. Rough runtime: 10-20 s on the shared machine (one
stack start).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client, EngineError
from shared.protocol.errors import ErrorCode
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import free_port, running_stack

pytestmark = pytest.mark.e2e

FAIL_TOKEN = 4242
MAX_TOKENS = 24
INNOCENT = [[100 + 31 * n + i for i in range(6 + n)] for n in range(8)]  # never FAIL_TOKEN
POISONED = [7, 8, FAIL_TOKEN, 9, 10]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        worker="sim",
        sim_config=SimConfig(fail_token=FAIL_TOKEN),
        scheduler_config=SchedulerConfig(max_num_seqs=4),
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        gateway=False,
        log_dir=tmp_path_factory.mktemp("logs"),
        drain_timeout_s=5.0,
    )
    yield from running_stack(settings)


async def _stream(client: AsyncClient, ids: list[int]) -> list[list[int]]:
    """Each chunk's token ids, in order; raises EngineError when the request fails."""
    chunks = []
    async for chunk in client.stream(prompt_token_ids=ids, max_tokens=MAX_TOKENS,
                                     temperature=0.0, ignore_eos=True):  # fmt: skip
        chunks.append(chunk.token_ids)
    return chunks


async def _all_at_once(address: str) -> list[list[list[int]] | BaseException]:
    async with AsyncClient(address, timeout=60.0) as client:
        # the poisoned one fifth: it waits, then starts together with innocent ones
        order = [*INNOCENT[:4], POISONED, *INNOCENT[4:]]
        return await asyncio.gather(*(_stream(client, ids) for ids in order),
                                    return_exceptions=True)  # fmt: skip


def _log_events(path: Path, event: str) -> list[dict]:
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


def test_a_failing_request_fails_alone(stack: LocalStack) -> None:
    with Client(stack.frontend_address, timeout=60.0) as client:
        alone = [client.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True).token_ids for ids in INNOCENT]  # fmt: skip
    results = asyncio.run(_all_at_once(stack.frontend_address))
    poisoned, innocent = results[4], results[:4] + results[5:]
    assert isinstance(poisoned, EngineError) and poisoned.code == ErrorCode.WORKER_FAILED
    for n, chunks in enumerate(innocent):
        assert not isinstance(chunks, BaseException), (n, chunks)
        assert [t for chunk in chunks for t in chunk] == alone[n], n  # none lost or repeated
    faults = _log_events(stack.log_dir / "worker.log", "simulated_step_fault")
    assert 1 <= len(faults) <= 8, faults  # bisection: a few failed steps, not one per step
    culprit = faults[-1]["rids"]
    assert len(culprit) == 1
    pinned = _log_events(stack.log_dir / "scheduler.log", "step_failure_pinned")
    assert len(pinned) == len(faults)
    assert pinned[0]["num_seqs"] > 1 and pinned[0]["failed_rids"] == []  # bisected, not failed
    assert [p["failed_rids"] for p in pinned if p["failed_rids"]] == [culprit]
    assert pinned[-1]["num_seqs"] == 1  # pinned once it failed alone
    with Client(stack.frontend_address, timeout=30.0) as client:
        deadline = time.monotonic() + SLOW_HOST_MARGIN_S
        while True:  # an idle engine: every block free, the failed request's state dropped
            engine = client.stats()["engine"]
            released = {e["rid"] for e in _log_events(stack.log_dir / "worker.log",
                                                       "sequence_released")}  # fmt: skip
            done = engine["kv_blocks_used"] == 0 and culprit[0] in released
            if done or time.monotonic() > deadline:
                break
            client.generate(prompt_token_ids=INNOCENT[0], max_tokens=1)  # carries releases
    assert engine["kv_blocks_used"] == 0, engine
    assert culprit[0] in released, "the worker was never told to drop the failed request"
