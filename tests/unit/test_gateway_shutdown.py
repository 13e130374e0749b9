"""The gateway's shutdown stops its background polls even when a cancel is lost
(services/gateway/app.py `stop_tasks`). On Python <= 3.11 `asyncio.wait_for` returns the inner
call's result and drops a cancel that arrives as that call finishes; a poll loop then runs on,
and the lifespan's plain `gather` kept the gateway alive after SIGTERM (seen once in CI: the
front-door test's gateway did not exit within 15 s). The race is made here on purpose: the
inner call finishes and the cancel arrives in the same turn of the loop."""

from __future__ import annotations

import asyncio
import sys

from services.gateway.app import STOP_ROUND_S, stop_tasks


async def _poll(inner: list[asyncio.Future[None]], rounds: list[int]) -> None:
    """A health-poller-shaped loop: one wait_for round trip, then a short sleep."""
    loop = asyncio.get_running_loop()
    while True:
        inner.append(loop.create_future())
        await asyncio.wait_for(inner[-1], 5.0)
        rounds.append(len(inner))
        await asyncio.sleep(0.01)


async def _cancel_as_the_call_finishes() -> tuple[asyncio.Task[None], list[int], float]:
    inner: list[asyncio.Future[None]] = []
    rounds: list[int] = []
    task = asyncio.ensure_future(_poll(inner, rounds))
    await asyncio.sleep(0.01)  # the poll waits in its first wait_for
    inner[-1].set_result(None)  # the reply lands ...
    started = asyncio.get_running_loop().time()
    await stop_tasks([task])  # ... in the same turn as the shutdown's first cancel
    return task, rounds, asyncio.get_running_loop().time() - started


def test_a_poll_that_loses_a_cancel_is_still_stopped() -> None:
    task, rounds, took = asyncio.run(_cancel_as_the_call_finishes())
    assert task.done() and task.cancelled()
    if sys.version_info < (3, 12):
        assert rounds == [1]  # the first cancel was dropped: the poll went on to a second call
    assert took < 3 * STOP_ROUND_S  # a second round's cancel stopped it


def test_polls_that_take_the_cancel_stop_in_one_round() -> None:
    async def run() -> tuple[list[asyncio.Task[None]], float]:
        tasks = [asyncio.ensure_future(asyncio.sleep(60)) for _ in range(2)]
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        await stop_tasks(tasks)  # type: ignore[arg-type]
        return tasks, asyncio.get_running_loop().time() - started  # type: ignore[return-value]

    tasks, took = asyncio.run(run())
    assert all(t.cancelled() for t in tasks)
    assert took < STOP_ROUND_S
