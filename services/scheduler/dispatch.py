"""When plan N+1 leaves under async scheduling: now, or just before step N is expected to end.

With overlap (`--async-scheduling`) plan N+1 used to leave right after plan N, so a request
arriving while step N runs could join plan N+2 at the earliest: one extra step of
time-to-first-token. vLLM's async scheduling and SGLang's overlap scheduler pay the same; on a
GPU (steps of a few ms) it is noise, on this CPU (steps of 100-600 ms) it is most of a turn's
TTFT gain from prefix caching (the figure that keeps it: docs/design/scheduler.md).

The policy (`DispatchPolicy`), asked by the scheduler loop whenever plan N is in flight and
plan N+1 could be built, decides by itself from the step times it measures: it is no user
switch (the one overlap switch is `--async-scheduling`); the internal config field
`SchedulerConfig.just_in_time_plans` lets tests and experiments turn it off. The rule:

* **short steps: send now** (what overlap was built for). A step is short when its expected
  time is under `HOLD_MIN_RATIO` times the scheduler's own path (its work between a result and
  the next plan leaving: `update()`, `schedule()`, encode, send), or under `HOLD_MIN_STEP_S`.
  Holding there would risk a gap of about one path per step: too much of a 5 ms step (the
  simulated H200, a real GPU), or of a zero-cost worker's; and the loop's timer (a poll with a
  millisecond timeout, woken late by a busy machine) cannot aim within a few ms.
* **long steps: hold plan N+1 until `lead` before step N's expected end**, so that requests
  arriving meanwhile join it. If result N arrives first, the loop plans at once (no timer is
  needed for that): the worst case of a late send is the path's gap once, i.e. the synchronous
  loop's, at most 1/`HOLD_MIN_RATIO` of that step. A send that is early only costs what every
  send cost before: arrivals after it wait one more step. `lead` = max(`LEAD_PATHS` paths,
  `LEAD_FRACTION` of the expected step): room to build and send the plan, and for the noise in
  step times, so that most held plans still reach the worker before it finishes step N.
* **no estimate for this kind of step yet**: on a worker whose steps are long (some class seen
  is long enough to hold), hold plan N+1 until result N arrives (an unknown step on a slow
  worker: the late send costs one path once, an early one a step of TTFT for every arrival);
  otherwise, or before any step was seen, send now.

The estimate (`StepTimeEstimator`) is the median of the worker's own recent step times
(`forward_s` of its results) among comparable steps: steps of the same kind (decodes only, or
with prompt tokens: a CPU's matrix-matrix kernels and prefill set-up cost extra) whose scheduled
token count has the same power-of-two size (1, 2-3, 4-7, ..., 256-511, ...), the last `WINDOW`
of each. Why not a
per-token cost fitted over all steps: on this CPU a decode step's time is dominated by
per-sequence work (attention over each context), not by its token count (16 decodes took
113-185 ms, a 512-token prompt step ~140 ms), so one line misses one of the two kinds badly;
a median per size class follows each kind, ignores the outliers other processes cause on shared
cores, and adapts as contexts grow (old entries roll out). A class never seen has no estimate.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Optional

HOLD_MIN_RATIO = 50.0  # hold only when the step is >= 50 paths long: a late send costs <= 2%
HOLD_MIN_STEP_S = 0.02  # ... and >= 20 ms: ten times the 2 ms the lead leaves at least
LEAD_MIN_S = 0.002  # the poll's millisecond timeout and its wake-up: send >= 2 ms early
LEAD_PATHS = 2.0  # send at least two paths before the expected end
LEAD_FRACTION = 0.1  # ... and at least 10% of the expected step before it
WINDOW = 8  # recent steps kept per size class
PATH_SMOOTHING = 0.25  # weight of the newest path measurement in its moving average


def size_class(num_tokens: int, decode_only: bool = True) -> tuple[int, bool]:
    """Steps of one kind and of 2**(k-1) .. 2**k - 1 scheduled tokens share class (k, kind)."""
    return (max(num_tokens, 0).bit_length(), decode_only)


class StepTimeEstimator:
    """Expected worker time of a step, from the worker's own times of recent comparable steps.
    Fed with every result (`observe`); empty after `reset` (a new worker)."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._window = window
        self._recent: dict[tuple[int, bool], deque[float]] = {}

    def observe(self, num_tokens: int, decode_only: bool, forward_s: float) -> None:
        """Called with each step result: the plan's scheduled tokens, whether they were all
        decodes, and the worker's time."""
        if forward_s < 0:
            return  # a clock step on the worker: no information
        key = size_class(num_tokens, decode_only)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=self._window)
        recent.append(forward_s)

    def predict(self, num_tokens: int, decode_only: bool) -> Optional[float]:
        """The median recent time of steps of this class; None when none was seen."""
        recent = self._recent.get(size_class(num_tokens, decode_only))
        return median(recent) if recent else None

    def longest(self) -> Optional[float]:
        """The largest estimate over the classes seen; None before any step."""
        return max((median(r) for r in self._recent.values()), default=None)


class DispatchPolicy:
    """Decides when plan N+1 leaves while plan N is in flight (one per worker: a new core, a
    new policy). `enabled=False` always sends at once (the eager overlap of before)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.estimator = StepTimeEstimator()
        self.path_s: Optional[float] = None  # moving average of the scheduler's own path

    def on_result(self, num_tokens: int, decode_only: bool, forward_s: float) -> None:
        """Called with each result: its plan (`num_tokens` scheduled, all decodes or not) took
        the worker `forward_s`."""
        self.estimator.observe(num_tokens, decode_only, forward_s)

    def on_path(self, seconds: float) -> None:
        """Called with the scheduler's own time between a result and the plan it sends next
        (update + schedule + encode + send), measured or composed of its parts."""
        if seconds < 0:
            return
        last = self.path_s
        self.path_s = seconds if last is None else last + PATH_SMOOTHING * (seconds - last)

    def send_at(self, num_tokens: int, decode_only: bool, started_at: float) -> Optional[float]:
        """When plan N+1 should leave, given plan N (`num_tokens` scheduled, all decodes or
        not) whose step began at `started_at` (time.time()); None: now; infinity: when result
        N arrives."""
        if not self.enabled or self.path_s is None:
            return None
        shortest_held = max(HOLD_MIN_RATIO * self.path_s, HOLD_MIN_STEP_S)
        expected = self.estimator.predict(num_tokens, decode_only)
        if expected is None:  # a step of a new kind: wait for it on a slow worker
            longest = self.estimator.longest()
            return math.inf if longest is not None and longest >= shortest_held else None
        if expected < shortest_held:
            return None
        lead = max(LEAD_PATHS * self.path_s, LEAD_FRACTION * expected, LEAD_MIN_S)
        return started_at + expected - lead
