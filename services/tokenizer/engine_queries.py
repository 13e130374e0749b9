"""Queries a client asks and the engines answer (`stats`, `reset_prefix_cache`), fanned out.

The frontend sends each query to every engine it is connected to and keeps it open until all
of them answered or the query's deadline, whichever comes first; reports.py answers the
client either way (with what it got: an engine that did not answer is reported as None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from shared.protocol import client_channel as cc
from shared.protocol.engine_channel import ResetPrefixCache, StatsQuery
from shared.protocol.errors import ErrorCode

STATS = "stats"
RESET_PREFIX_CACHE = "reset_prefix_cache"

# Engine stats that are ratios or flags: combined across engines other than by summing.
_MAX_KEYS = ("ready", "draining", "prefix_caching")
_MEAN_KEYS = ("batch_utilization",)


@dataclass
class PendingQuery:
    identity: bytes  # the client connection that asked
    client_id: Optional[str]  # its `id`, echoed in the reply
    deadline: float  # time.monotonic() after which the frontend answers alone
    kind: str  # STATS or RESET_PREFIX_CACHE
    waiting: set[int]  # engines (indexes) asked and not answered yet
    answers: dict[int, Union[dict[str, float], int]] = field(default_factory=dict)
    asked: tuple[int, ...] = ()  # every engine asked, in order


class PendingQueries:
    """Open queries by query id; ids are unique per frontend (its id and a counter)."""

    def __init__(self, frontend_id: str, timeout_s: float) -> None:
        self._frontend_id = frontend_id
        self._timeout_s = timeout_s
        self._open: dict[str, PendingQuery] = {}
        self._num_opened = 0

    def message(self, kind: str) -> Union[StatsQuery, ResetPrefixCache]:
        """A new query's message (its id unique to this frontend), to send every engine."""
        qid = f"{self._frontend_id}-{kind}-{self._num_opened}"
        self._num_opened += 1
        return StatsQuery(qid) if kind == STATS else ResetPrefixCache(qid)

    def open(
        self,
        qid: str,
        identity: bytes,
        client_id: Optional[str],
        kind: str,
        now: float,
        engines: list[int],
    ) -> PendingQuery:
        """Record a client's query `qid`, sent to `engines`. With no engine it is not kept:
        the caller answers at once."""
        query = PendingQuery(identity, client_id, now + self._timeout_s, kind, set(engines),
                             asked=tuple(engines))  # fmt: skip
        if engines:
            self._open[qid] = query
        return query

    def answer(
        self, qid: str, engine: int, value: Union[dict[str, float], int]
    ) -> Optional[PendingQuery]:
        """Record engine `engine`'s answer; the query, now closed, once every engine asked has
        answered (else None: still open, or answered or expired already)."""
        query = self._open.get(qid)
        if query is None or engine not in query.waiting:
            return None
        query.waiting.discard(engine)
        query.answers[engine] = value
        return None if query.waiting else self._open.pop(qid)

    def expired(self, now: float) -> list[PendingQuery]:
        """Every open query past its deadline, now closed."""
        late = [qid for qid, q in self._open.items() if now > q.deadline]
        return [self._open.pop(qid) for qid in late]

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when an open query waits on an engine it did not
        ask, holds an answer it still waits for, or waits on nothing (it would be closed)."""
        for qid, query in self._open.items():
            asked = set(query.asked)
            assert query.waiting and query.waiting <= asked, (qid, query)
            assert set(query.answers) <= asked and not set(query.answers) & query.waiting, qid
            assert query.kind in (STATS, RESET_PREFIX_CACHE), query.kind


def combine_stats(per_engine: list[dict[str, float]]) -> Optional[dict[str, float]]:
    """The stats of several engines as one engine's: counts and gauges summed, KV use and the
    prefix-cache hit rate recomputed from their sums, flags the maximum, the batch utilization
    the mean. None when no engine answered."""
    if not per_engine:
        return None
    if len(per_engine) == 1:
        return dict(per_engine[0])
    out: dict[str, float] = {}
    for stats in per_engine:
        for key, value in stats.items():
            out[key] = out.get(key, 0.0) + value
    for key in _MAX_KEYS:
        if key in out:
            out[key] = max(s.get(key, 0.0) for s in per_engine)
    for key in _MEAN_KEYS:
        if key in out:
            out[key] /= len(per_engine)
    if out.get("kv_blocks_total"):
        out["kv_usage"] = out.get("kv_blocks_used", 0.0) / out["kv_blocks_total"]
    if "prefix_cache_hit_rate" in out:
        queries = out.get("prefix_cache_queries", 0.0)
        out["prefix_cache_hit_rate"] = (
            out.get("prefix_cache_hits", 0.0) / queries if queries else 0.0
        )
    return out


def stats_reply(
    query: PendingQuery, names: list[str], ready: bool, frontend: dict[str, float]
) -> bytes:
    """The client's `stats` reply: `engine` the engines combined, `engines` each by name
    (None for one that did not answer in time)."""
    per_engine = {name: query.answers.get(i) for i, name in enumerate(names)}
    answered = [s for s in per_engine.values() if isinstance(s, dict)]
    return cc.stats_reply(query.client_id, ready, frontend, combine_stats(answered), per_engine)


def reset_reply(query: PendingQuery, names: list[str]) -> bytes:
    """The client's `reset_prefix_cache` reply: blocks dropped by all engines, or an error
    naming the engines that did not answer (or that none was connected)."""
    missing = [names[i] for i in query.asked if i not in query.answers]
    if missing or not query.asked:
        which = f"engine(s) {', '.join(missing)}" if missing else "no engine"
        message = f"{which} did not answer reset_prefix_cache in time"
        return cc.error_reply(ErrorCode.ENGINE_UNREACHABLE, message, query.client_id)
    dropped = sum(int(n) for n in query.answers.values() if not isinstance(n, dict))
    return cc.reset_prefix_cache_reply(query.client_id, dropped)
