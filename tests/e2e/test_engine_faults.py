"""Issue test 5, first half: killing the worker fails every in-flight request with
`worker_failed` and turns `health` to not ready within 5 s; stopping leaves no process.

A private stack (the shared engine must stay healthy) with the SIMULATED worker
(services.simworker): it runs the same worker loop (shared/worker_server.py) over the same
sockets, and starts in a second instead of loading a model. Rough runtime: 10-30 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from conveyor.launcher import LocalStack
from shared.client import AsyncClient, Client, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import engine_settings, wait_gone

pytestmark = pytest.mark.e2e

NUM_IN_FLIGHT = 4
NOT_READY_WITHIN_S = 5.0 + SLOW_HOST_MARGIN_S  # promised: 5 s (README, Faults)


async def _stream_until_error(client: AsyncClient, n: int, started: asyncio.Event) -> str:
    stream = client.stream(prompt=f"Story {n}:", max_tokens=6000, ignore_eos=True)
    try:
        async for _chunk in stream:
            started.set()
    except EngineError as exc:
        return exc.code
    return "finished"


async def _kill_worker_mid_stream(address: str, worker_pid: int) -> list[str]:
    async with AsyncClient(address, timeout=60.0) as client:
        events = [asyncio.Event() for _ in range(NUM_IN_FLIGHT)]
        tasks = [
            asyncio.create_task(_stream_until_error(client, n, ev)) for n, ev in enumerate(events)
        ]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), timeout=120)
        os.kill(worker_pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)


def test_killing_the_worker_fails_requests_and_health(tmp_path: Path) -> None:
    settings = engine_settings(tmp_path / "logs", gateway=False, worker="sim", worker_flags={})
    stack = LocalStack(settings).start()
    try:
        stack.wait_ready(timeout=300)
        pids = list(stack.pids().values())
        codes = asyncio.run(_kill_worker_mid_stream(stack.frontend_address, stack.pids()["worker"]))
        killed_at = time.monotonic()
        assert codes == ["worker_failed"] * NUM_IN_FLIGHT
        with Client(stack.frontend_address, timeout=10.0) as client:
            while (health := client.health())["ready"] and (
                time.monotonic() - killed_at < NOT_READY_WITHIN_S
            ):
                time.sleep(0.1)
            assert health["ready"] is False, health
            assert health["reason"] == "worker_lost"
            with pytest.raises(EngineError) as refused:
                client.generate("Hello", max_tokens=2)
            assert refused.value.code == "not_ready"
    finally:
        stack.stop()
    assert wait_gone(pids, timeout=10) == []
