"""The front door: what the gateway answers from the request line and headers alone.

A plain ASGI middleware in front of everything else (FastAPI's routing, body reading, pydantic):
* `GET /health` is answered from the engine's last known health (health.py), never a round trip;
* a completion from a client already at its cap (admission.py) gets its 429 before the body is
  read or parsed.
Both cost one pass of the event loop and a few hundred bytes, whatever the load, so a probe or
a refused client does not queue behind the admitted requests' parsing. The server discards a
refused request's body as it arrives (it is never buffered). Everything else passes through.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.admission import Admission, client_key
from services.gateway.health import HealthWatch

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # counted per client


class FrontDoor:
    def __init__(self, app: ASGIApp, health: HealthWatch, admission: Admission) -> None:
        self._app = app
        self._health = health
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if path == "/health" and method == "GET":
                await _answer(send, *self._health.answer())
                return
            if method == "POST" and path in ADMITTED_PATHS:
                key = client_key(scope)
                if self._admission.is_full(key):
                    err = self._admission.refusal(key)
                    await _answer(send, err.status, orjson.dumps(err.body()))
                    return
        await self._app(scope, receive, send)


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
