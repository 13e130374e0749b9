"""The one record of plans in flight (one, or two with async scheduling): what the core needs
to apply each result and what the process loop needs to time, hold back and log each step.

`InFlightSteps` is owned by the core (services/scheduler/scheduler.py): `schedule()` adds a
step, `update()` takes the oldest, a failed step or a lost worker clears them. The loop
(services/scheduler/server.py) reads it and stamps each step when its plan has left
(`InFlightStep.mark_sent`); it keeps no list of its own.

With overlap (SGLang's overlap scheduler, vLLM's async scheduling) plan N+1 is built before the
result of step N arrives, assuming every running request goes on. What keeps the bookkeeping
exact (tested against a worker answering out of phase, tests/unit/test_async_scheduling.py):

* the worker runs plans in order, so a block freed while building plan N+1 (a preemption) or
  after result N (a finish, an abort) may be handed out again in any later plan: whatever
  still writes to it runs first;
* a request samples into `token_ids[len(token_ids)]`; a result's token is applied only if the
  request was not preempted after the plan was built and has computed at least that far. A
  preempted request drops the samples of the plans built before its preemption and recomputes
  the same tokens (samples depend on the rid and the output index): it may be readmitted and
  recompute past an old sample's position before that sample lands, so how far it has
  computed alone cannot tell an old sample from a new one (a sample at index 1 from before the
  preemption once landed as index 2 that way);
* a request that finished at step N is in plan N+1 already: it computes one extra token, which
  result N+1 drops (the request is no longer running); its slot and blocks were released with
  the first plan built after result N. A request whose sample in flight is its last by length
  (max_tokens, max_model_len) is not scheduled again: that costs no extra step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

from services.scheduler.request import Request
from services.scheduler.stats import StepRecord
from shared.protocol.worker_channel import StepPlan
from shared.step_cost import StepShape


@dataclass(slots=True)
class InFlightStep:
    plan: StepPlan
    record: StepRecord  # what the core decided (the step log line)
    # [S] every sequence that samples, in the worker's batch order: result token i is the
    # sample of sampled[i] (the result names no rids); sampled_rids[i] is its rid
    sampled: list[Request]
    sampled_rids: list[str]
    # (request, preemption count, full blocks) of prefill chunks that fill blocks (prefix
    # caching): queued for registration once this step's result arrives, see BuiltStep
    filled: list[tuple[Request, int, int]]
    # the running set's `version` when it was built: a request preempted since
    # (`Request.preempted_at_version` above it) drops this plan's sample for it
    version: int
    # every held request decodes and none is new: while the running set's version is still
    # `version` when the result arrives, the result may take the steady path
    # (services/scheduler/steady.py `SteadyDecodes.apply`)
    steady: bool
    # speculation: (request, draft limit) of each decode that might draft (`BuiltStep.drafts`)
    drafts: list[tuple[Request, int]] = field(default_factory=list)
    shape: Optional[StepShape] = None  # what it computes (the step-time predictor's input)
    sent_at: float = 0.0  # time.time() when the plan left (`mark_sent`)
    gap_s: Optional[float] = None  # previous result -> this plan, when sent back to back

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    @property
    def rids(self) -> list[str]:
        """Every request that computes in it (a failed step fails these)."""
        return self.record.rids

    def mark_sent(self, sent_at: float, gap_s: Optional[float]) -> None:
        """Called by the loop once the plan has left."""
        self.sent_at = sent_at
        self.gap_s = gap_s


class InFlightSteps:
    """Plans sent and not yet answered, oldest first (at most `max_in_flight`)."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self._steps: deque[InFlightStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[InFlightStep]:
        return iter(self._steps)

    def has_room(self) -> bool:
        return len(self._steps) < self.max_in_flight

    def oldest(self) -> Optional[InFlightStep]:
        """The step whose result comes next."""
        return self._steps[0] if self._steps else None

    def newest(self) -> Optional[InFlightStep]:
        """The step of the last plan built."""
        return self._steps[-1] if self._steps else None

    def add(self, step: InFlightStep) -> None:
        """Called by `schedule()` with the plan it built."""
        if len(self._steps) >= self.max_in_flight:
            raise RuntimeError("schedule() called with every plan slot in flight")
        self._steps.append(step)

    def take(self, step_id: int) -> InFlightStep:
        """Called by `update()`: the oldest step, which `step_id` must name."""
        steps = self._steps
        if not steps or step_id != steps[0].plan.step_id:
            expected = steps[0].step_id if steps else None
            raise ValueError(f"result for step {step_id} but step {expected} is next")
        return steps.popleft()

    def clear(self) -> None:
        """A failed step or a lost worker: no result will come for any of them."""
        self._steps.clear()
