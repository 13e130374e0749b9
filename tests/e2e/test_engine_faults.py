"""Faults survived (issue 14, 34): `conveyor up` as a real child process, SIMULATED worker
(same worker loop and sockets as the real one, starts in a second; its greedy tokens depend only
on the prompt and the position, like a real model's). The same kills on the REAL model are in
test_faults_real.py; these measure how fast the engine is ready again.

* `kill -9` of the worker under 16 streams: `up` restarts it, the worker re-handshakes, every
  request it held is recomputed, and every stream ends with exactly the tokens of an undisturbed
  run (no chunk duplicated or lost); ready again within 10 s; no KV block leaked.
* `--max-retries 0`: the same kill ends the streams with `worker_failed`; then a `kill -9` of
  the scheduler: `up` restarts it and the frontend resumes every stream on it (docs/design/
  resumption.md): each ends with exactly its undisturbed tokens.
`--restart no` (a death stops the engine) is tested in test_launcher.py.
Rough runtime: 40-80 s on the shared machine (two `up` starts).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from shared.client import AsyncClient, Client, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import UpProcess, descendants, start_up, wait_gone

pytestmark = pytest.mark.e2e

NUM_STREAMS = 16
WORKER_MODULE = "services.worker.sim"
MAX_TOKENS = 400  # ~5.4 ms per modelled decode step: mid-way at the kill
# promised: 10 s, measured: RELIABILITY.md
READY_AGAIN_WITHIN_S = 10.0 + SLOW_HOST_MARGIN_S
WAIT_S = 120.0
PROMPTS = [f"Parcel {n} travels along the belt to" for n in range(NUM_STREAMS)]


def _service_pid(up: UpProcess, module: str) -> int:
    return next(pid for pid, cmd in descendants(up.proc.pid).items() if module in cmd)


async def _stream(client: AsyncClient, prompt: str, started: asyncio.Event) -> list[list[int]]:
    """Each chunk's token ids, in order; raises EngineError when the request fails."""
    chunks = []
    async for chunk in client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True):  # fmt: skip
        chunks.append(chunk.token_ids)
        started.set()
    return chunks


async def _streams_with_a_kill(address: str, pid: int) -> tuple[list, float]:
    """16 streams; once each has a chunk, SIGKILL `pid`. (results or exceptions, kill time)"""
    async with AsyncClient(address, timeout=60.0) as client:
        events = [asyncio.Event() for _ in PROMPTS]
        tasks = [
            asyncio.create_task(_stream(client, p, ev))
            for p, ev in zip(PROMPTS, events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), timeout=WAIT_S)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    return list(results), killed_at


def _ready_again(address: str, out: list[float]) -> None:
    """Polls health until it was not ready and is ready again: appends that moment."""
    seen_down = False
    deadline = time.monotonic() + WAIT_S
    with Client(address, timeout=10.0) as c:
        while time.monotonic() < deadline:
            ready = c.health()["ready"]
            seen_down |= not ready
            if ready and seen_down:
                out.append(time.monotonic())
                return
            time.sleep(0.05)


def _kill_under_load(up: UpProcess, address: str, module: str) -> tuple[list, float]:
    """Kill `module`'s process under 16 streams; (stream results, seconds until ready again)."""
    pid = _service_pid(up, module)
    ready_at: list[float] = []
    watcher = threading.Thread(target=_ready_again, args=(address, ready_at), daemon=True)
    watcher.start()
    results, killed_at = asyncio.run(_streams_with_a_kill(address, pid))
    watcher.join(WAIT_S)
    assert ready_at, "the engine did not become ready again"
    assert _service_pid(up, module) != pid  # `up` started a new one
    return results, ready_at[0] - killed_at


def _engine_stats(address: str) -> dict[str, float]:
    with Client(address, timeout=10.0) as c:
        return c.stats()["engine"]


def _undisturbed(address: str) -> list[list[int]]:
    """Every prompt's tokens, the 16 requests at once (one after the other took ~30 s)."""

    async def run() -> list[list[int]]:
        async with AsyncClient(address, timeout=WAIT_S) as client:
            replies = await asyncio.gather(*(
                client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                for p in PROMPTS))  # fmt: skip
        return [r.token_ids for r in replies]

    return asyncio.run(run())


def test_worker_killed_under_load_loses_nothing(tmp_path: Path) -> None:
    up, address = start_up(tmp_path)
    try:
        want = _undisturbed(address)
        results, recovery_s = _kill_under_load(up, address, WORKER_MODULE)
        for got, ref in zip(results, want, strict=True):
            assert not isinstance(got, BaseException), got
            flat = [t for chunk in got for t in chunk]
            assert flat == ref  # every token once, in order: none lost or repeated
        stats = _engine_stats(address)
        assert stats["kv_blocks_used"] == 0 and stats["num_live_requests"] == 0, stats
        scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text()
        assert '"event":"worker_lost"' in scheduler_log
        print(f"\nworker (sim) kill -9: ready again after {recovery_s:.2f} s")  # RELIABILITY.md
        assert recovery_s < READY_AGAIN_WITHIN_S
    finally:
        _stop(up)


def test_retries_exhausted_give_worker_failed_then_scheduler_restart(tmp_path: Path) -> None:
    up, address = start_up(tmp_path, "--max-retries", "0")
    try:
        results, _ = _kill_under_load(up, address, "services.worker.sim")
        codes = {r.code if isinstance(r, EngineError) else "finished" for r in results}
        assert codes == {"worker_failed"}, codes
        with Client(address, timeout=30.0) as c:
            assert len(c.generate("after", max_tokens=4, temperature=0.0).token_ids) == 4
        want = _undisturbed(address)
        results, recovery_s = _kill_under_load(up, address, "services.scheduler")
        print(f"\nscheduler kill -9: ready again after {recovery_s:.2f} s")  # RELIABILITY.md
        for got, ref in zip(results, want, strict=True):  # resumed: every token once, in order
            assert not isinstance(got, BaseException), got
            assert [t for chunk in got for t in chunk] == ref
        assert _engine_stats(address)["num_resumptions_admitted"] >= 1
    finally:
        _stop(up)


def _stop(up: UpProcess) -> None:
    children = list(descendants(up.proc.pid))
    up.proc.send_signal(signal.SIGTERM)
    rc, _out, err = up.finish(timeout=60)
    assert rc == 0, err[-2000:]
    assert wait_gone(children, timeout=10 + SLOW_HOST_MARGIN_S) == []
