"""TTFT and TPOT of the requests that finished in the last minute, for the `stats` reply.

`conveyor top` shows them; /metrics has whole-life histograms, this is the recent view an
operator watches. The frontend records each finished request (`record`, when it logs
request_finished) and reads percentiles when a client asks for stats (`percentiles`); entries
older than the window are dropped on both calls, so memory stays bounded by the requests that
finish within one window.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

WINDOW_S = 60.0
QUANTILES = (50, 90, 99)


class LatencyWindow:
    """(finished at, ttft, tpot) of recent requests, oldest first. One owner: the loop thread."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._entries: deque[tuple[float, Optional[float], Optional[float]]] = deque()

    def record(self, now: float, ttft_s: Optional[float], tpot_s: Optional[float]) -> None:
        """A request finished at monotonic `now` (None: it had no first token / one token)."""
        self._entries.append((now, ttft_s, tpot_s))
        self._expire(now)

    def percentiles(self, now: float) -> dict[str, float]:
        """`num_finished_1m` and, when known, `ttft_p50_s` ... `tpot_p99_s` over the window."""
        self._expire(now)
        out: dict[str, float] = {"num_finished_1m": float(len(self._entries))}
        for name, column in (("ttft", 1), ("tpot", 2)):
            values = sorted(e[column] for e in self._entries if e[column] is not None)
            for q in QUANTILES:
                if values:
                    out[f"{name}_p{q}_s"] = nearest_rank(values, q)
        return out

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when entries are out of time order or a duration
        is negative."""
        times = [e[0] for e in self._entries]
        assert times == sorted(times), times
        for _, ttft_s, tpot_s in self._entries:
            assert (ttft_s is None or ttft_s >= 0) and (tpot_s is None or tpot_s >= 0)

    def _expire(self, now: float) -> None:
        while self._entries and self._entries[0][0] < now - self.window_s:
            self._entries.popleft()


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (nearest-rank) of a non-empty sorted list."""
    rank = max(int(-(-q * len(sorted_values) // 100)), 1)  # ceil(q/100 * n), at least 1
    return sorted_values[min(rank, len(sorted_values)) - 1]
