"""The engine's own time per step, seen from the simulated worker.

Between the end of one `execute` (its result is about to be sent) and the start of the next
(the next plan has arrived and been decoded) lies everything that is not the model: result
encoding and transport, the scheduler's update, output routing to the tokenizer, the next
schedule, plan encoding and transport. With the zero-cost profile that gap is the whole step.
Only pure decode steps are recorded (every sequence computes one token), grouped by the number
of running sequences, so a steady batch of N decodes yields a clean figure for N.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import structlog

GAP_EVENT = "sim_engine_gap"  # the log event bench/sim_overhead.py reads


def _percentile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


class GapRecorder:
    """Collects engine gaps per batch size; logs a summary every `report_every` steps of one size.

    Called by the runner: `step_started` when `execute` begins, `step_finished` when it returns.
    """

    def __init__(self, report_every: int, log: Any) -> None:
        self._report_every = report_every
        self._log = log if log is not None else structlog.get_logger()
        self._last_end: Optional[float] = None
        self._gaps: dict[int, list[float]] = defaultdict(list)
        self._exec: dict[int, list[float]] = defaultdict(list)
        self._pending: Optional[tuple[int, float, Optional[float]]] = None

    def step_started(self, now: float, num_seqs: int, pure_decode: bool) -> None:
        gap = None if self._last_end is None else now - self._last_end
        self._pending = (num_seqs, now, gap) if pure_decode else None

    def step_finished(self, now: float) -> None:
        self._last_end = now
        if self._pending is None:
            return
        num_seqs, start, gap = self._pending
        self._pending = None
        if gap is None:
            return
        self._gaps[num_seqs].append(gap)
        self._exec[num_seqs].append(now - start)
        if len(self._gaps[num_seqs]) >= self._report_every:
            self._report(num_seqs)

    def _report(self, num_seqs: int) -> None:
        gaps = sorted(self._gaps.pop(num_seqs))
        execs = self._exec.pop(num_seqs)
        self._log.info(
            GAP_EVENT,
            simulated=True,
            num_seqs=num_seqs,
            steps=len(gaps),
            gap_mean_us=round(1e6 * sum(gaps) / len(gaps), 1),
            gap_p50_us=round(1e6 * _percentile(gaps, 0.5), 1),
            gap_p90_us=round(1e6 * _percentile(gaps, 0.9), 1),
            gap_p99_us=round(1e6 * _percentile(gaps, 0.99), 1),
            execute_mean_us=round(1e6 * sum(execs) / len(execs), 1),
        )
