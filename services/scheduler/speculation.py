"""Speculative decoding, the scheduler's side: one policy object (`Speculation`) behind the
step filler and the result path (docs/design/speculation.md).

The worker proposes drafts (it holds the up-to-date histories); the scheduler gives each decode
a draft *limit*, the KV slots and the token budget for it, and applies what the worker accepted:

* `check_in_flight(step, goes_on)` (the step filler, after the decodes): the decodes with
  drafts in flight are checked again counting them (the filler's pass over every decode does
  not read D, so it costs nothing when speculation is off);
* `assign(step)` (the step filler, last, after the prompts): a limit `k` per decode, within
  the token budget the prompts left, the free blocks (drafts never preempt) and the request's
  length limit (`k <= max_len - (C + D) - 2`, C its computed count, D its draft slots in
  flight);
* `settle(flight, result)` (the result path, with a result of a step that had drafts): per
  drafting request `C += accepted`, `D -= k`, the blocks past `C + D` given back (the next plan
  trims the worker's table); returns the accepted drafts (and their logprobs, for a request
  that asked) per sampler row.

Only `C` decides what the prefix cache may register, so a block holding a rejected draft's KV is
never registered: registrations stop at `C // block_size` blocks and every position below C
holds the KV of a confirmed token once the plans in flight have run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from services.scheduler.draft_budget import DraftBudget
from services.scheduler.inflight import InFlightStep
from services.scheduler.request import Request, RequestStatus
from services.scheduler.running import RunningSet
from services.scheduler.step import StepBuilder
from shared.protocol.worker_channel import DraftOutcome, StepResult, TokenLogprobs
from shared.step_cost import StepCostPredictor

RUNNING = RequestStatus.RUNNING


class Accepted(NamedTuple):
    """A row's accepted drafts and their logprobs (one per draft, or none: not asked)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]


NO_DRAFTS = Accepted([], [])  # read-only
_NONE: tuple[int, list[int], list[TokenLogprobs]] = (0, [], [])  # read-only


class SpecContractError(ValueError):
    """A result whose speculation columns do not fit the step's draft limits."""


@dataclass(slots=True)
class SpecCounters:
    """Since start, in vLLM's shape: drafts (rows that proposed), draft tokens, accepted
    tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < accepted:
            per_pos.extend([0] * (accepted - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def as_stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for j, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos_{j}"] = n
        return out


class Speculation:
    """Draft limits and their results for one running set (built by `Scheduler._assemble`
    when the worker speculates and `num_speculative_tokens` >= 1)."""

    def __init__(
        self,
        batch: RunningSet,
        num_speculative_tokens: int,
        block_size: int,
        counters: SpecCounters,
        predictor: StepCostPredictor,
    ) -> None:
        """`counters`: the scheduler's, kept across rebuilds (a lost worker); `predictor`: the
        scheduler's step-time predictor, which the draft limits read."""
        self._batch = batch
        self._k = num_speculative_tokens
        self._block_size = block_size
        self.counters = counters
        self._in_flight: set[Request] = set()  # given drafts by a plan built (D may be > 0)
        self._budget = DraftBudget(num_speculative_tokens, predictor)

    def check_in_flight(
        self, step: StepBuilder, goes_on: Callable[[Request, StepBuilder], bool]
    ) -> None:
        """Called by the step filler once the step's decodes are in, before any prompt: a
        decode with drafts in flight is checked again by `goes_on` (the filler's check, which
        counts them: its table must cover them, growing by policy; a sample in flight may end
        it), else it waits for the result in flight."""
        if not self._in_flight:
            return
        scheduled = set(step.decodes)
        for req in list(self._in_flight):
            if req.num_draft_slots == 0:
                self._in_flight.discard(req)  # settled, finished or preempted
            elif req in scheduled and not goes_on(req, step):
                step.drop(req)

    def assign(self, step: StepBuilder) -> None:
        """Called by the step filler last, once prompts are in: each decode gets a draft limit
        while the token budget the prompts left, free blocks (drafts never preempt) and its
        length allow."""
        if not step.decodes or step.draft_budget_left <= 0:
            return
        candidates = [r for r in step.decodes if not r.padding]
        limits = self._budget.limits(candidates, step.final_shape())  # walked once a step
        if not limits:
            return
        bs, batch = self._block_size, self._batch
        for req in candidates:
            budget = step.draft_budget_left
            if budget <= 0:
                return
            base = req.num_computed_tokens + req.num_draft_slots + 1  # after this decode
            k = min(limits.get(id(req), 0), budget, req.max_len - base - 1)
            if k <= 0:
                continue
            if not batch.grow_if_free(req, base + k):
                k = min(k, len(req.block_ids) * bs - base)  # what its table covers already
            if k > 0:
                step.add_drafts(req, k)
                self._in_flight.add(req)

    def settle(self, flight: InFlightStep, result: StepResult) -> dict[int, Accepted]:
        """Called by the result path with a result of a step that gave draft limits (before
        its tokens are applied): each drafting request's counts move and its blocks past
        what the plans in flight may write are given back. Returns sampler row -> its
        accepted drafts and their logprobs (empty unless its request asked). Raises
        SpecContractError when the columns do not fit the limits."""
        accepted = _accepted_by_row(flight, result)
        limits = flight.drafts
        where = {id(req): i for i, req in enumerate(flight.sampled)}
        for req, k in limits:
            row = where.get(id(req))
            proposed, tokens, _ = accepted.get(row, _NONE) if row is not None else _NONE
            self._budget.observe_row(req, k, proposed, len(tokens))
            if proposed:
                self.counters.count(proposed, len(tokens))
                req.num_draft_tokens += proposed
                req.num_accepted_tokens += len(tokens)
            if req.status is not RUNNING or _is_stale(req, flight):
                self._budget.forget(req)
                continue  # finished, aborted or preempted since: its drafts went with its table
            req.num_draft_slots -= k
            req.num_computed_tokens += len(tokens)
            self._batch.give_back(req, req.num_computed_tokens + req.num_draft_slots)
        self._batch.touch()  # computed counts moved outside the steady path's arithmetic
        return {row: Accepted(t, lps) for row, (_, t, lps) in accepted.items() if t}


def _is_stale(req: Request, flight: InFlightStep) -> bool:
    preempted = req.preempted_at_version
    return preempted is not None and preempted > flight.version


def _accepted_by_row(
    flight: InFlightStep, result: StepResult
) -> dict[Optional[int], tuple[int, list[int], list[TokenLogprobs]]]:
    """Sampler row -> (drafts proposed, accepted drafts, their logprobs), checked against the
    step's limits (and, for a request that asked for logprobs, one per accepted draft)."""
    outcome = result.drafts or DraftOutcome()
    rows, proposed, accepted = outcome.rows, outcome.proposed, outcome.accepted
    if not len(rows) == len(proposed) == len(accepted) or sum(accepted) != len(outcome.token_ids):
        raise SpecContractError("the result's speculation columns differ in length")
    limit_of = {id(req): k for req, k in flight.drafts}
    all_lps = outcome.logprobs or []
    out: dict[Optional[int], tuple[int, list[int], list[TokenLogprobs]]] = {}
    start = at_lp = 0
    for row, n_proposed, n_accepted in zip(rows, proposed, accepted, strict=True):
        if not 0 <= row < len(flight.sampled) or row in out:
            raise SpecContractError(f"speculation row {row} is no sampler of the step")
        req = flight.sampled[row]
        limit = limit_of.get(id(req), 0)
        if not 0 <= n_accepted <= n_proposed <= limit:
            raise SpecContractError(
                f"row {row}: {n_accepted} accepted of {n_proposed} drafts, limit {limit}"
            )
        lps: list[TokenLogprobs] = []
        if req.sampling.logprobs is not None and n_accepted:
            lps = all_lps[at_lp : at_lp + n_accepted]
            at_lp += n_accepted
            if len(lps) != n_accepted:
                raise SpecContractError(f"row {row}: logprobs asked, not given for its drafts")
        out[row] = (n_proposed, outcome.token_ids[start : start + n_accepted], lps)
        start += n_accepted
    if at_lp != len(all_lps):
        raise SpecContractError("the result's draft logprobs do not fit the rows that asked")
    return out
