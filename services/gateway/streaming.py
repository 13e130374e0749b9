"""Server-sent events for streamed completions, and a response that always cleans up.

The event sequence per HTTP request (OpenAI's): for chat, one role chunk per choice; then text
chunks as they come (a chat with tools: read for calls by tools.py, each complete call as two
`tool_calls` delta chunks: id and name, then its arguments); one finish chunk per choice;
with `stream_options.include_usage`, a last chunk with no choices and the usage; then
`data: [DONE]`. An engine failure after the 200 went out becomes one `data: {"error": {...}}`
event (the openai package raises it as an APIError).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Optional

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.events import ChoiceEnd, TextDelta
from services.gateway.fanout import ChoiceRuns
from services.gateway.openai_schema import EngineCallPlan
from services.gateway.responses import (
    SSE_DONE,
    ChoiceState,
    ResponseMeta,
    delta_chunk,
    finish_chunk,
    role_chunk,
    sse,
    tool_call_chunks,
    usage,
    usage_chunk,
)
from services.gateway.tools import ToolCallReader


async def sse_body(
    meta: ResponseMeta,
    plan: EngineCallPlan,
    runs: ChoiceRuns,
    on_error: Callable[[Optional[str]], None],
    log: Any,
) -> AsyncIterator[bytes]:
    """The bytes of one event stream; ends early (error event) when a choice fails."""
    with_logprobs = plan.num_logprobs is not None
    include_usage = plan.include_usage
    states = [ChoiceState() for _ in plan.calls]
    readers = [ToolCallReader() if plan.tool_mode else None for _ in plan.calls]
    if meta.kind == "chat":
        for index in range(len(plan.calls)):
            yield sse(role_chunk(meta, index, include_usage))
    ends: list[ChoiceEnd] = []
    async for event in runs.events():
        if not isinstance(event, ChoiceEnd):
            reader = readers[event.index]
            pieces = [event] if reader is None else _pieces(event, reader.feed(event.text))
            for piece in pieces:
                for chunk in _piece_chunks(meta, piece, event.index, states, with_logprobs,
                                           include_usage):  # fmt: skip
                    yield sse(chunk)
        elif event.error is not None:
            on_error(event.error.code)
            log.info("request_failed", rid=meta.id, status=event.error.status,
                     code=event.error.code, message=event.error.message)  # fmt: skip
            yield sse(event.error.body())
            yield SSE_DONE
            return
        else:
            ends.append(event)
            reader = readers[event.index]
            if reader is not None:
                for piece in _pieces(event, reader.finish()):
                    for chunk in _piece_chunks(meta, piece, event.index, states, False,
                                               include_usage):  # fmt: skip
                        yield sse(chunk)
            made_calls = reader is not None and bool(reader.calls)
            yield sse(finish_chunk(meta, event, include_usage, made_calls))
    totals = usage(plan.calls, ends)
    log.info("request_done", rid=meta.id, usage=totals)
    if include_usage:
        yield sse(usage_chunk(meta, totals))
    yield SSE_DONE


def _pieces(event: TextDelta | ChoiceEnd, found: list[Any]) -> list[Any]:
    """A reader's pieces as deltas (content keeps the event's logprobs, on its first piece)."""
    out: list[Any] = []
    for piece in found:
        if isinstance(piece, str):
            first = not any(isinstance(p, TextDelta) for p in out)
            logprobs = event.logprobs if first and isinstance(event, TextDelta) else []
            out.append(TextDelta(event.index, piece, [], logprobs))
        else:
            out.append(piece)
    return out


def _piece_chunks(
    meta: ResponseMeta,
    piece: Any,
    index: int,
    states: list[ChoiceState],
    with_logprobs: bool,
    include_usage: bool,
) -> list[dict[str, Any]]:
    if not isinstance(piece, TextDelta):
        return tool_call_chunks(meta, index, piece, include_usage)
    # Empty text with no logprobs carries nothing (text held back for a stop string).
    if piece.text or (with_logprobs and piece.logprobs):
        return [delta_chunk(meta, piece, states[index], with_logprobs, include_usage)]
    return []


class ClosingStreamingResponse(StreamingResponse):
    """An event stream whose `on_close` runs however the response ends.

    When the client disconnects, Starlette cancels the task writing the body; the body
    generator may then be left suspended at a `yield` and only finalized later by the garbage
    collector. Running `on_close` here, shielded from that cancellation, aborts the engine
    requests at once instead.
    """

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
                if isinstance(self._content, AsyncGenerator):
                    await self._content.aclose()
