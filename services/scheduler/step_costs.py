"""What the step-time predictor (shared/step_cost.py) learns from: each sampled step's shape
and measured time. The one owner of those inputs (the scheduler core calls it from `_build`,
`update` and `after_plan`); the predictor itself is shared with its readers (slo_policy.py,
draft_budget.py), which only call `predict`.

Learning has a cost on the scheduler's path: a step's shape is O(rows) (a walk over every
decode's computed count) and a full refit ~30 ms every 256 observations (in `after_plan`, one
of its 9 starting splits per step, so no frontend waits for all of it). So the predictor learns
from every step only where a policy reads it (`--policy slo`, speculation); elsewhere from one
step in `every`, for the error figures `engine_summary` and /metrics report.
"""

from __future__ import annotations

from typing import Optional

from services.scheduler.inflight import InFlightStep
from services.scheduler.step import StepBuilder
from shared.protocol.worker_channel import StepResult
from shared.step_cost import StepCostPredictor, StepShape

# Where no policy reads the predictor it learns from one step in this many: its first fit after
# 64 observations then comes after 1,024 steps, each refit every 4,096.
SAMPLED_EVERY = 16


class StepCosts:
    def __init__(self, predictor: StepCostPredictor, every: int) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.predictor = predictor
        self._every = every

    def shape(self, step_id: int, step: StepBuilder) -> Optional[StepShape]:
        """Called by `_build` before the step's computed counts move: its shape when the
        predictor learns from this step, else None (nothing walked)."""
        return step.final_shape() if step_id % self._every == 0 else None

    def observe(self, flight: InFlightStep, result: StepResult, step_s: Optional[float]) -> None:
        """Called with each result of the oldest step in flight. Its time: the worker's
        `forward_s`, or `step_s` (the loop's measure: from when the step could begin to its
        result) when shorter: a pipelined worker's `forward_s` counts from the step's launch,
        while the step before it still ran, so it can be up to two steps long; hence never
        below half of `forward_s` either: a loop measure that short is a result read late, just
        after the one before it (SIMULATED 70B at 2x load: one 0.4 ms sample of a 20 ms step,
        weighed 50x by the fit's relative error, left every step predicted at ~2 ms for the
        rest of the run). The drafts the worker proposed were computed too: they join the
        shape."""
        if flight.shape is None or flight.step_id != result.step_id:
            return
        seconds = result.forward_s
        if step_s is not None:
            seconds = min(seconds, max(step_s, seconds / 2))
        shape = flight.shape
        if result.drafts is not None:
            shape = shape.with_drafts(result.drafts.proposed)
        self.predictor.observe(shape, seconds)

    def after_plan(self) -> None:
        """Called off the result -> plan path: the predictor refits when due."""
        self.predictor.maybe_refit()

    def stats(self) -> dict[str, float]:
        """The predictor's recent p50 / p90 relative error, once it has fitted."""
        errors = self.predictor.errors()
        if errors is None:
            return {}
        return {"step_predictor_p50_error": errors[0], "step_predictor_p90_error": errors[1]}
