"""Request body limit (`--max-body-bytes`), as a plain ASGI middleware in front of every route.

A body over the limit is answered 413 in OpenAI's error shape (code `request_too_large`) as soon
as the excess is known: at once from Content-Length, else while the chunks arrive, so a 70 MB
body is never held in memory. Within the limit the body is handed to the route unchanged, and
later `receive` calls pass through (the routes listen for the client's disconnect).
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import ApiError
from shared.protocol.errors import ErrorCode


def too_large(limit: int) -> ApiError:
    message = f"request body is larger than this gateway's limit of {limit} bytes"
    return ApiError(413, message, "invalid_request_error", None, ErrorCode.REQUEST_TOO_LARGE)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self._app = app
        self._limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if self._declared_length(scope) > self._limit:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body ended
                await self._app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self._app(scope, _replay([body], None, receive), send)

    def _declared_length(self, scope: Scope) -> int:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                return int(value) if value.isdigit() else 0
        return 0

    async def _refuse(self, send: Send) -> None:
        body = orjson.dumps(too_large(self._limit).body())
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _replay(first: list[Message], last: Message | None, receive: Receive) -> Receive:
    """A `receive` that returns the buffered messages, then defers to the real one."""
    queued = [*first, *([last] if last is not None else [])]

    async def replay() -> Message:
        if queued:
            return queued.pop(0)
        return await receive()

    return replay
