"""Draining an engine for maintenance (issue 34; docs/design/resumption.md): real processes,
SIMULATED workers (greedy tokens depend only on the prompt and the position), the command a
user runs (`conveyor drain --engine I`).

* Two engines: 16 streams run on both; `conveyor drain --engine 0` moves engine 0's streams to
  engine 1 by resumption and waits until engine 0 holds nothing (exit 0); every stream equals
  its undisturbed text; health says engine 0 is `draining` and new requests go to engine 1;
  `--undo` makes it admit again.
* One engine: nothing can move; a request that ends within the drain time-out completes, one
  that does not ends `shutting_down`; `--undo` and it serves again.
Rough runtime: 20-40 s on the shared 2-core machine (two small stacks).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.scheduler.server_config import ServerConfig
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import ROOT, free_port

pytestmark = pytest.mark.e2e

# ~110 ms per simulated step (the cpu-smollm2 profile): 100 tokens take ~11 s, long enough for
# the drain command to start while they stream
JOBS = [dict(prompt=f"Crate {i} leaves the dock", max_tokens=100, temperature=0.0,
             ignore_eos=True) for i in range(16)]  # fmt: skip
DRAIN_TIMEOUT_S = 3.0


def _settings(log_dir: Path, num_engines: int, device: str) -> StackSettings:
    return StackSettings(
        worker="sim", sim_config=SimConfig(device=device, model="smollm2-135m"), gateway=False,
        frontend_address=f"tcp://127.0.0.1:{free_port()}", log_dir=log_dir,
        drain_timeout_s=DRAIN_TIMEOUT_S, data_parallel_size=num_engines,
        scheduler_config=SchedulerConfig(max_num_seqs=16),
        server_config=ServerConfig(summary_interval_s=0.0),
    )  # fmt: skip


def _drain(address: str, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "conveyor", "drain", "--address", address, *flags]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _records(log_dir: Path, service: str) -> list[dict[str, Any]]:
    text = (log_dir / f"{service}.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def _all_at_once(address: str) -> list[list[int]]:
    async with AsyncClient(address, timeout=120.0) as client:
        done = await asyncio.gather(*(client.generate(**job) for job in JOBS))
    return [d.token_ids for d in done]


async def _streams_with_a_drain(address: str, drain: Any) -> list[list[int]]:
    """Every job streamed at once; once each has a chunk, `drain()` runs (in a thread)."""
    started = [asyncio.Event() for _ in JOBS]
    async with AsyncClient(address, timeout=120.0) as client:

        async def one(job: dict[str, Any], first: asyncio.Event) -> list[int]:
            tokens: list[int] = []
            async for chunk in client.stream(**job):
                tokens += chunk.token_ids
                first.set()
            return tokens

        tasks = [asyncio.create_task(one(j, e)) for j, e in zip(JOBS, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120.0)
        await asyncio.to_thread(drain)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120.0))


def test_drain_moves_an_engines_streams_to_the_other(tmp_path: Path) -> None:
    with LocalStack(_settings(tmp_path, 2, "cpu-smollm2")) as stack:
        address = stack.frontend_address
        want = asyncio.run(_all_at_once(address))
        done: list[subprocess.CompletedProcess[str]] = []
        got = asyncio.run(_streams_with_a_drain(
            address, lambda: done.append(_drain(address, "--engine", "0"))))  # fmt: skip
        assert got == want  # every stream whole, resumed or not: none lost or repeated
        (cli,) = done
        assert cli.returncode == 0, cli.stderr
        first = json.loads(cli.stdout.splitlines()[0])
        assert first["engine"] == "0" and first["draining"] is True and first["num_moved"] >= 1
        assert json.loads(cli.stdout.splitlines()[-1]) == {"engine": "0", "drained": True}
        with Client(address, timeout=60.0) as c:
            engines = c.health()["engines"]
            assert (engines[0]["ready"], engines[0]["reason"]) == (False, "draining")
            c.generate("During the drain", max_tokens=4, request_id="during")
        moved = [r for r in _records(tmp_path, "tokenizer") if r.get("event") == "request_resumed"]
        assert moved and {(r["from_engine"], r["engine"], r["reason"]) for r in moved} == {
            ("0", "1", "drained")}  # fmt: skip
        routed = {r["client_id"]: r["engine"] for r in _records(tmp_path, "tokenizer")
                  if r.get("event") == "request_received"}  # fmt: skip
        assert routed["during"] == "1"
        undo = _drain(address, "--engine", "0", "--undo")
        assert undo.returncode == 0, undo.stderr
        _until_ready(address, 0)


def _until_ready(address: str, engine: int) -> None:
    deadline = time.monotonic() + 10.0 + SLOW_HOST_MARGIN_S
    with Client(address, timeout=30.0) as c:
        while not c.health()["engines"][engine]["ready"]:
            assert time.monotonic() < deadline, "the engine did not admit again"
            time.sleep(0.2)


def test_drain_of_the_only_engine_waits_then_ends_what_is_left(tmp_path: Path) -> None:
    with LocalStack(_settings(tmp_path, 1, "cpu-smollm2")) as stack:
        address = stack.frontend_address
        with Client(address, timeout=60.0) as short, Client(address, timeout=60.0) as long_:
            quick = short.stream("Short one", max_tokens=8, ignore_eos=True)
            slow = long_.stream("Long one", max_tokens=2000, ignore_eos=True)
            next(quick)
            next(slow)
            started = time.monotonic()
            cli = _drain(address, "--engine", "0", "--wait", "0")
            assert cli.returncode == 0 and json.loads(cli.stdout)["num_moved"] == 0, cli
            assert sum(len(c.token_ids) for c in quick) >= 1 and quick.done is not None
            with pytest.raises(EngineError) as ended:
                for _chunk in slow:
                    pass
        assert ended.value.code == "shutting_down"
        assert time.monotonic() - started < DRAIN_TIMEOUT_S + 5.0 + SLOW_HOST_MARGIN_S
        with Client(address, timeout=30.0) as c:
            with pytest.raises(EngineError) as refused:
                c.generate("While drained", max_tokens=2)
            assert refused.value.code == "not_ready"
        assert _drain(address, "--engine", "0", "--undo").returncode == 0
        _until_ready(address, 0)
        with Client(address, timeout=30.0) as c:
            assert len(c.generate("After the drain", max_tokens=3).token_ids) == 3
