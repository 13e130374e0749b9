"""The engine's health as last heard, so that `/health` answers at once under any load.

A background task asks the frontend `health` every `HEALTH_POLL_S`; `/health` answers from the
last reply instead of a round trip of its own, so a probe never queues behind the requests the
gateway and the frontend are busy with. The answer is never older than the staleness bound:
with no reply for `stale_after_s`, `/health` says 503 `engine_unreachable`; a lost connection
(`EngineError`) says so at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import orjson

from services.gateway.errors import ApiError, from_engine_error
from shared.client import EngineError
from shared.protocol.errors import ErrorCode

HEALTH_POLL_S = 0.5  # how often the frontend is asked
HEALTH_TIMEOUT_S = 5.0  # a reply later than this is a failed poll
STALE_AFTER_S = 5.0  # no reply for this long: unreachable, even while a poll still waits


class HealthWatch:
    """Polls the engine's health (`run`, the app's lifetime) and answers `/health` (`answer`)."""

    def __init__(self, client: Any, stale_after_s: float = STALE_AFTER_S) -> None:
        self._client = client
        self._stale_after_s = stale_after_s
        self._reply: Optional[dict[str, Any]] = None  # the last reply, while it is fresh
        self._reply_at = 0.0  # monotonic time of that reply
        self._failure: Optional[str] = None  # why the last poll failed (None: it did not)

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(HEALTH_POLL_S)

    async def poll(self) -> None:
        """One `health` round trip; its reply, or why it failed, is what `answer` says next."""
        try:
            self._reply = await asyncio.wait_for(self._client.health(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineError) as exc:
            self._failure = exc.message if isinstance(exc, EngineError) else "no answer in time"
            return
        self._reply_at, self._failure = time.monotonic(), None

    def answer(self) -> tuple[int, bytes]:
        """(HTTP status, JSON body) of `/health` now: 200 when the engine accepts requests,
        else 503 with the engine's reason. Never waits."""
        age = time.monotonic() - self._reply_at
        if self._failure is not None or self._reply is None or age > self._stale_after_s:
            why = self._failure or (
                "no answer yet" if self._reply is None else f"no answer for {age:.1f} s"
            )
            return _error(from_engine_error(ErrorCode.ENGINE_UNREACHABLE, why))
        if not self._reply.get("ready"):
            reason = self._reply.get("reason") or "unknown"
            return _error(from_engine_error(ErrorCode.NOT_READY, f"engine not ready: {reason}"))
        body = {"status": "ok", "model": self._reply.get("model"),
                "max_model_len": self._reply.get("max_model_len")}  # fmt: skip
        return 200, orjson.dumps(body)


def _error(err: ApiError) -> tuple[int, bytes]:
    return err.status, orjson.dumps(err.body())
