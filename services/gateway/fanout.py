"""Run the engine requests of one HTTP request (n choices x prompts) and merge their events.

Every choice is its own streaming engine request, read by its own asyncio task into one queue,
so choices progress independently and the route sees one ordered stream of events. Closing the
`ChoiceRuns` cancels the tasks; each task closes its client stream on the way out, and closing a
stream aborts its engine request: that is how a vanished HTTP client frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

import anyio

from services.gateway.errors import from_engine_error
from services.gateway.events import ChoiceEnd, ChoiceEvent, delta_from_chunk, end_from_done
from services.gateway.openai_schema import EngineCall
from shared.client import AsyncClient, EngineError
from shared.client.async_client import AsyncStream
from shared.protocol.errors import ErrorCode


class ChoiceRuns:
    """One HTTP request's engine requests: `start()`, read `events()`, then always `aclose()`.

    Invariant: after `aclose` no task of it is alive and every engine request it started
    has either ended or been aborted.
    """

    def __init__(
        self,
        client: AsyncClient,
        calls: list[EngineCall],
        on_end: Callable[[ChoiceEnd], None],
        on_abort: Callable[[int], None],
        log: Any,
    ) -> None:
        self._client = client
        self._log = log
        self._calls = calls
        self._on_end = on_end  # each choice that finished (metrics)
        self._on_abort = on_abort  # how many choices were cut short (metrics)
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._held: list[ChoiceEvent] = []  # events read by `first_error`, replayed by `events`
        self._num_open = len(calls)

    def start(self) -> None:
        """Send every engine request (one reading task each). Called once; `aclose` undoes it."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(call)) for call in self._calls]

    async def first_error(self) -> Optional[ChoiceEnd]:
        """Wait until every choice produced its first event; the first failed choice, if any.

        Called before an HTTP status is chosen, so that a request the engine refuses (full
        queue, prompt too long) gets a real 4xx/5xx instead of an error inside a 200 stream.
        """
        started: set[int] = set()
        while len(started) < len(self._calls):
            event = await self._queue.get()
            if isinstance(event, ChoiceEnd) and event.error is not None:
                self._num_open -= 1  # ended, not aborted: the caller reports the error
                return event
            self._held.append(event)
            started.add(event.index)
        return None

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every event of every choice, in arrival order, until all choices ended.

        A failed choice ends the iteration at once (its ChoiceEnd is the last event).
        """
        while self._num_open > 0:
            event = self._held.pop(0) if self._held else await self._queue.get()
            if isinstance(event, ChoiceEnd):
                self._num_open -= 1
                if event.error is None:
                    self._on_end(event)
                yield event
                if event.error is not None:
                    return
            else:
                yield event

    async def aclose(self) -> None:
        """Cancel what still runs and wait for it, shielded: this often runs because the HTTP
        client left and our own task is being cancelled, and the aborts must still go out."""
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._num_open > 0:
            self._on_abort(self._num_open)
            self._num_open = 0

    async def _pump(self, call: EngineCall) -> None:
        """One choice's events into the queue; it always ends with a ChoiceEnd, whatever fails
        (a request that cannot be encoded fails in `stream()` itself)."""
        stream: Optional[AsyncStream] = None
        try:
            stream = self._client.stream(**call.kwargs)
            async for chunk in stream:
                await self._queue.put(delta_from_chunk(call.index, chunk))
            await self._queue.put(end_from_done(call.index, stream.done))
        except EngineError as exc:
            error = from_engine_error(exc.code, exc.message)
            await self._queue.put(ChoiceEnd(call.index, None, error=error))
        except Exception as exc:  # noqa: BLE001 - the boundary: the HTTP request must end
            self._log.exception("choice_failed", index=call.index)
            message = f"internal error: {type(exc).__name__} (logged)"
            error = from_engine_error(ErrorCode.INTERNAL, message)
            await self._queue.put(ChoiceEnd(call.index, None, error=error))
        finally:
            if stream is not None:
                await stream.aclose()
