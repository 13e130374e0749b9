"""Bearer-token check for /v1/*, as a plain ASGI middleware.

It answers 401 before the route reads the body (so an unauthenticated client learns nothing
about validation), and, being plain ASGI, it leaves streaming responses and client-disconnect
signals untouched. /health and /metrics stay open, as on vLLM, for probes and scrapers.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.api_keys import ApiKeys
from services.gateway.errors import unauthorized

PROTECTED_PREFIX = "/v1"
KEY_STATE = "api_key"  # the request's matched ApiKey, in its scope's state


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self._app = app
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self._app(scope, receive, send)
            return
        key = self._keys.match(scope)
        if key is not None:
            # the route reads the key's class from here: one match per request
            scope.setdefault("state", {})[KEY_STATE] = key
            await self._app(scope, receive, send)
            return
        err = unauthorized()
        body = orjson.dumps(err.body())
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
