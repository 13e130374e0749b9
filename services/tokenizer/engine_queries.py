"""Queries a client asks and the scheduler answers (`stats`, `reset_prefix_cache`).

The frontend keeps each open query until the scheduler's answer or the query's deadline,
whichever comes first; the server answers the client either way (an expired query with what
the frontend knows alone, or an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from shared.protocol.engine_channel import ResetPrefixCache, StatsQuery

STATS = "stats"
RESET_PREFIX_CACHE = "reset_prefix_cache"


@dataclass(frozen=True, slots=True)
class PendingQuery:
    identity: bytes  # the client connection that asked
    client_id: Optional[str]  # its `id`, echoed in the reply
    deadline: float  # time.monotonic() after which the frontend answers alone
    kind: str  # STATS or RESET_PREFIX_CACHE


class PendingQueries:
    """Open queries by query id; ids are unique per frontend (its id and a counter)."""

    def __init__(self, frontend_id: str, timeout_s: float) -> None:
        self._frontend_id = frontend_id
        self._timeout_s = timeout_s
        self._open: dict[str, PendingQuery] = {}
        self._num_opened = 0

    def open(
        self, identity: bytes, client_id: Optional[str], kind: str, now: float
    ) -> Union[StatsQuery, ResetPrefixCache]:
        """Record a client's query; returns the message to send the scheduler."""
        qid = f"{self._frontend_id}-{kind}-{self._num_opened}"
        self._num_opened += 1
        self._open[qid] = PendingQuery(identity, client_id, now + self._timeout_s, kind)
        return StatsQuery(qid) if kind == STATS else ResetPrefixCache(qid)

    def take(self, qid: str) -> Optional[PendingQuery]:
        """The open query `qid`, now closed; None when it was answered or expired already."""
        return self._open.pop(qid, None)

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(query id, kind) of every open query past its deadline (still open: `take` closes)."""
        return [(qid, q.kind) for qid, q in self._open.items() if now > q.deadline]
