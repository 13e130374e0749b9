"""Who may send the engine more requests: engine requests in flight per client, capped.

One owner for the count (`Admission`): the front door asks `is_full` from the headers alone,
before a body is read, so a refusal costs no parsing; a route takes a `Slot` for the engine
requests it is about to send (once it knows how many) and releases it when they are closed.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from starlette.types import Scope

from services.gateway.errors import ApiError, from_engine_error
from shared.protocol.errors import ErrorCode


def client_key(scope: Scope) -> str:
    """Whom the cap counts: the API key when one is sent, else the peer address."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return "key:" + value.decode("latin-1")
    client = scope.get("client")
    return "addr:" + (client[0] if client else "unknown")


class Slot:
    """One HTTP request's engine requests, counted against its client until released."""

    def __init__(self, admission: Admission, key: str, num_requests: int) -> None:
        self._admission, self._key, self._num_requests = admission, key, num_requests

    def release(self) -> None:
        """Idempotent: called when the engine requests are closed, or the request failed."""
        if self._num_requests:
            self._admission.give_back(self._key, self._num_requests)
            self._num_requests = 0


class Admission:
    """Engine requests in flight per client key, at most `cap` each (0: no cap)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._in_flight: Counter[str] = Counter()

    def is_full(self, key: str) -> bool:
        """True when `key` may start no engine request: what the front door refuses early."""
        return bool(self.cap) and self._in_flight[key] >= self.cap

    def refusal(self, key: str) -> ApiError:
        """The 429 for a request that would pass `key`'s cap."""
        message = (
            f"this client already has {self._in_flight[key]} requests in flight "
            f"(limit {self.cap}); wait for one to end"
        )
        return from_engine_error(ErrorCode.OVERLOADED, message)

    def take(self, key: str, num_requests: int) -> Optional[Slot]:
        """A slot for `num_requests` engine requests, or None when they would pass the cap."""
        if self.cap and self._in_flight[key] + num_requests > self.cap:
            return None
        self._in_flight[key] += num_requests
        return Slot(self, key, num_requests)

    def give_back(self, key: str, num_requests: int) -> None:
        """Called by a `Slot` once: its engine requests are closed."""
        left = self._in_flight[key] - num_requests
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)
