"""What the scheduler remembers of each plan in flight (one, or two with async scheduling).

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

from dataclasses import dataclass
from typing import Optional

from services.scheduler.request import Request


@dataclass(slots=True)
class InFlightStep:
    step_id: int
    rids: list[str]  # every request that computes in it (a failed step fails these)
    # [S] every sequence that samples, in the worker's batch order: result token i is the
    # sample of sampled[i] (the result names no rids); sampled_rids[i] is its rid
    sampled: list[Request]
    sampled_rids: list[str]
    # (request, preemption count, full blocks) of prefill chunks that fill blocks (prefix
    # caching): queued for registration once this step's result arrives, see BuiltStep
    filled: list[tuple[Request, int, int]]
    # a steady plan (every held request decodes, none new): the running set's `num_changes`
    # when it was built; None otherwise. Unchanged when its result arrives: every request in
    # it is running, has sampled before and is not protected (the fast path of `update`)
    steady_mark: Optional[int] = None
    # the running set's `version` when it was built: a request preempted since
    # (`Request.preempted_at_version` above it) drops this plan's sample for it
    version: int = 0
