"""The periodic `engine_summary` log line: how the engine is doing, every few seconds.

Like vLLM's periodic "Avg prompt throughput ..." line: while there is work, the scheduler logs
once per `interval_s` the prompt and generation tokens per second over that interval, the requests
running / waiting / preempted, the KV pool's use, the prefix cache's hit rate (only when the
core reports one), the drafts' acceptance (only while speculation drafts: tokens drafted and
accepted, the mean acceptance length and the acceptance per position), the median step time
and the step-time predictor's p50 / p90 relative error (once it has fitted). Idle, it logs
nothing.

The server calls `on_step` after each step's result and `maybe_emit` from its housekeeping (at
least every HOUSEKEEPING_S), so a line comes at most about half a second late. Rates are counter
differences over the interval: `stats()` counters are monotonic, so nothing is double-counted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any, Optional

# Counters a core may report for prefix caching (hits / looked-up prompt tokens); when the core
# has no prefix cache they are absent and the summary leaves the hit rate out.
PREFIX_HIT_KEY = "num_prefix_cache_hit_tokens"
PREFIX_QUERY_KEY = "num_prefix_cache_query_tokens"
# Speculation's counters (services/scheduler/speculation.py), present when the worker drafts.
DRAFT_KEY, ACCEPTED_KEY = "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"
ROWS_KEY, POS_KEY = "spec_decode_num_drafts", "spec_decode_num_accepted_tokens_pos_"
# the step-time predictor's p50 / p90 relative error (shared/step_cost.py), once it has fitted
PREDICTOR_P50_KEY = "step_predictor_p50_error"
PREDICTOR_P90_KEY = "step_predictor_p90_error"


class EngineSummary:
    """Collects step times between summaries; `interval_s == 0` turns it off. One owner, the
    scheduler's loop thread."""

    def __init__(self, interval_s: float, log: Any) -> None:
        if interval_s < 0:
            raise ValueError("summary interval must be >= 0 (0 turns it off)")
        self.interval_s = interval_s
        self._log = log
        self._step_s: list[float] = []
        self._started_at: Optional[float] = None  # monotonic start of the current interval
        self._last: Optional[Mapping[str, float]] = None  # stats at that start

    def on_step(self, step_s: float) -> None:
        """After each step result: plan sent -> result received, in seconds."""
        if self.interval_s:
            self._step_s.append(step_s)

    def maybe_emit(
        self, now: float, read_stats: Callable[[], Optional[Mapping[str, float]]]
    ) -> Optional[dict]:
        """From the loop's housekeeping (every loop turn: cheap unless an interval is due).
        `read_stats` gives the core's stats(), None while there is no core. Logs and returns
        the summary when an interval with work has ended, else None."""
        if not self.interval_s:
            return None
        elapsed = now - self._started_at if self._started_at is not None else None
        if elapsed is not None and elapsed < self.interval_s:
            return None
        stats = read_stats()
        if stats is None:  # no engine (worker not ready or lost): start afresh when it is back
            self._reset(now, None)
            return None
        if elapsed is None or self._last is None:
            self._reset(now, stats)
            return None
        busy = self._step_s or stats.get("num_running", 0) or stats.get("num_waiting", 0)
        summary = summarize(self._last, stats, elapsed, self._step_s) if busy else None
        if summary is not None:
            self._log.info("engine_summary", **summary)
        self._reset(now, stats)
        return summary

    def _reset(self, now: float, stats: Optional[Mapping[str, float]]) -> None:
        self._started_at = now if stats is not None else None
        self._last = dict(stats) if stats is not None else None
        self._step_s = []


def summarize(
    before: Mapping[str, float], after: Mapping[str, float], elapsed_s: float, step_s: list[float]
) -> dict[str, Any]:
    """The summary fields from two stats() snapshots `elapsed_s` apart and the step times
    between them (a pure function: the unit tests feed it directly)."""

    def delta(key: str) -> float:
        return max(after.get(key, 0.0) - before.get(key, 0.0), 0.0)

    out: dict[str, Any] = {
        "interval_s": round(elapsed_s, 3),
        "prompt_tokens_per_s": round(delta("num_prefill_tokens") / elapsed_s, 1),
        "generation_tokens_per_s": round(delta("num_output_tokens") / elapsed_s, 1),
        "num_running": int(after.get("num_running", 0)),
        "num_waiting": int(after.get("num_waiting", 0)),
        "num_preempted": int(delta("num_preemptions")),
        "kv_usage_pct": round(100.0 * after.get("kv_usage", 0.0), 1),
        "num_steps": len(step_s),
        "step_p50_ms": round(1000.0 * statistics.median(step_s), 1) if step_s else None,
    }
    if PREDICTOR_P90_KEY in after:  # the step-time predictor's recent relative error
        out["step_pred_err_p50_pct"] = round(100.0 * after.get(PREDICTOR_P50_KEY, 0.0), 1)
        out["step_pred_err_p90_pct"] = round(100.0 * after[PREDICTOR_P90_KEY], 1)
    queries = delta(PREFIX_QUERY_KEY)
    if PREFIX_QUERY_KEY in after and queries > 0:
        out["prefix_cache_hit_pct"] = round(100.0 * delta(PREFIX_HIT_KEY) / queries, 1)
    if delta(DRAFT_KEY) > 0:
        out.update(_drafts(delta, after))
    if pulls := delta("num_kv_pulls"):  # a decode engine's KV hand-overs in the interval
        seconds = delta("kv_pull_seconds")
        out.update(num_kv_pulls=int(pulls), kv_pull_mib=round(delta("kv_pull_bytes") / 2**20, 1),
                   kv_pull_gb_per_s=round(delta("kv_pull_bytes") / seconds / 1e9, 2)
                   if seconds else None)  # fmt: skip
    if leases := delta("num_leases_granted"):  # a prefill engine's
        out.update(num_leases_granted=int(leases), num_leases_held=int(after["num_leases"]))
    return out


def _drafts(delta: Callable[[str], float], after: Mapping[str, float]) -> dict[str, Any]:
    """Speculation over an interval with drafts, in vLLM's terms: draft and accepted tokens,
    the share accepted, the mean acceptance length (tokens a drafting decode emitted: 1 + its
    accepted drafts, averaged) and the acceptance per draft position (the share of drafting
    decodes whose first j + 1 drafts were all accepted)."""
    drafts, accepted, rows = delta(DRAFT_KEY), delta(ACCEPTED_KEY), delta(ROWS_KEY)
    out: dict[str, Any] = {
        "num_draft_tokens": int(drafts),
        "num_accepted_tokens": int(accepted),
        "draft_acceptance_pct": round(100.0 * accepted / drafts, 1),
    }
    if rows > 0:
        out["mean_acceptance_length"] = round(1.0 + accepted / rows, 2)
        positions = sorted(int(k[len(POS_KEY) :]) for k in after if k.startswith(POS_KEY))
        out["acceptance_per_position_pct"] = [
            round(100.0 * delta(f"{POS_KEY}{j}") / rows, 1) for j in positions
        ]
    return out
