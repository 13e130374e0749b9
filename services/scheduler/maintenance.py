"""Draining an engine for maintenance (`conveyor drain --engine I`, the DrainEngine message).

While draining, the engine admits nothing and tells every frontend EngineNotReady("draining");
each frontend moves its requests on this engine to its other engines by resumption
(docs/design/resumption.md). A frontend with no other engine leaves them here: they run to
their end, and whatever is still live `timeout_s` after the drain began ends `shutting_down`,
as a SIGTERM drain would end it. The engine keeps running and admits again when told
DrainEngine(drain=False), or when it is restarted.
"""

from __future__ import annotations

from typing import Any, Optional


class MaintenanceDrain:
    """The drain state of one engine; the loop calls `set` on DrainEngine and `overdue` from
    its housekeeping. Invariant: `since` is set exactly while draining."""

    def __init__(self, timeout_s: float, log: Any) -> None:
        self.timeout_s = timeout_s
        self._log = log
        self.since: Optional[float] = None  # monotonic start of the drain; None: not draining
        self._ended = False  # what was left at the time-out has been ended

    @property
    def active(self) -> bool:
        return self.since is not None

    def set(self, drain: bool, now: float, num_live: int) -> bool:
        """Start (or stop) draining; True when that changed anything."""
        if drain == self.active:
            return False
        self.since = now if drain else None
        self._ended = False
        self._log.info("maintenance_drain", drain=drain, num_live=num_live,
                       grace_s=self.timeout_s)  # fmt: skip
        return True

    def overdue(self, now: float, num_live: int) -> bool:
        """True once, when the grace period is over with requests still live: the caller ends
        them."""
        if self.since is None or self._ended or not num_live:
            return False
        if now - self.since <= self.timeout_s:
            return False
        self._ended = True
        return True
