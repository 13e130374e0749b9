"""Server-sent events for streamed completions, and a response that always cleans up.

The event sequence per HTTP request (OpenAI's): for chat, one role chunk per choice; then text
chunks as they come; one finish chunk per choice; with `stream_options.include_usage`, a last
chunk with no choices and the usage; then `data: [DONE]`. An engine failure after the 200 went
out becomes one `data: {"error": {...}}` event (the openai package raises it as an APIError).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Optional

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.events import ChoiceEnd
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
    usage,
    usage_chunk,
)


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
    if meta.kind == "chat":
        for index in range(len(plan.calls)):
            yield sse(role_chunk(meta, index, include_usage))
    ends: list[ChoiceEnd] = []
    async for event in runs.events():
        if not isinstance(event, ChoiceEnd):
            # Empty text with no logprobs carries nothing (text held back for a stop string).
            if event.text or (with_logprobs and event.logprobs):
                yield sse(
                    delta_chunk(meta, event, states[event.index], with_logprobs, include_usage)
                )
        elif event.error is not None:
            on_error(event.error.code)
            log.info("request_failed", rid=meta.id, status=event.error.status,
                     code=event.error.code, message=event.error.message)  # fmt: skip
            yield sse(event.error.body())
            yield SSE_DONE
            return
        else:
            ends.append(event)
            yield sse(finish_chunk(meta, event, include_usage))
    totals = usage(plan.calls, ends)
    log.info("request_done", rid=meta.id, usage=totals)
    if include_usage:
        yield sse(usage_chunk(meta, totals))
    yield SSE_DONE


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
