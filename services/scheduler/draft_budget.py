"""Adaptive draft limits: how many drafts each decode may take this step (speculation.py), so
that speculation never makes a step's tokens per second worse than plain decoding
(docs/design/speculation.md, "Adaptive k").

Two measurements, both from the engine's own results:

* the step time, from the scheduler's one step-time predictor (shared/step_cost.py, fitted
  from every step's shape and time, drafts included): the step as it stands, and the same
  step with every decode's k drafts, give each draft token's cost b (their difference per
  draft token). A fit that has seen no row compute more than one token cannot tell a draft's
  cost from the step's fixed cost: until it has, b is the step's mean cost per token, which
  only overstates it (drafts then look dearer);
* per request and per draft position j, how often the proposer offers a draft there (q_rj: a
  limit the proposer cannot fill costs nothing) and how often, when offered, the drafts up to
  it are all accepted (p_rj); exponential averages over its own drafting steps, started from
  the engine's averages.

The rule, per step: a limit reaching position j of request r adds q_rj * b seconds and
q_rj * p_rj expected tokens; limits are raised in order of p while p / b beats the step's
tokens per second so far (each one taken raises the bar), then kept only if the step's
predicted tokens per second is >= 2% above plain decoding's. A step that takes none still
lets one decode try its k drafts now and then, so an acceptance that has become better is seen
again (and the predictor sees steps with drafts even in one stream): every 16th step, the
interval doubling (up to 256) with each drafting row in a row that had nothing accepted, back
to 16 at the first acceptance, so a proposer that always fills its limit and is never right
(a draft model unlike the target) costs next to nothing. Before the predictor's first fit
decodes draft as configured, until 8 drafting rows in a row had nothing accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from services.scheduler.request import Request
from shared.step_cost import StepCostPredictor, StepShape

MIN_GAIN = 1.02  # drafts only where they pay at least 2% (the complexity budget's bar)
EXPLORE_EVERY = 16  # a step without drafts lets one decode try k every N steps
MAX_BACKOFF = 4  # ... N doubled per missing drafting row in a row, at most 2**4 times
BLIND_MISSES = 8  # before the first fit: drafting rows in a row with nothing accepted
ACCEPT_DECAY = 0.8  # per drafting step of a request: its last few steps weigh most
PRIOR_ACCEPT = 0.6  # a position's acceptance, given a draft was offered, before any result


@dataclass(slots=True)
class _Record:
    """One request's (or the engine's) drafting so far, per draft position j (0-based)."""

    proposed: list[float]  # P(the proposer offers a draft at j | the limit reaches j)
    accepted: list[float]  # P(drafts 0..j all accepted | a draft was offered at j)

    def learn(self, limit: int, num_proposed: int, num_accepted: int, weight: float) -> None:
        """Moves the averages by `weight` toward this row's outcome. Positions past the limit
        learn only when every draft was offered and accepted (as hits: the proposer was on a
        run), so a limit that shrank can grow again."""
        full = num_accepted == num_proposed == limit
        for j in range(len(self.proposed) if full else limit):
            offered = 1.0 if j < num_proposed or j >= limit else 0.0
            self.proposed[j] += weight * (offered - self.proposed[j])
            if offered:
                hit = 1.0 if j < num_accepted or j >= limit else 0.0
                self.accepted[j] += weight * (hit - self.accepted[j])

    def chances(self) -> list[tuple[float, float]]:
        """(P(accepted), P(offered)) per position, the acceptance made non-increasing."""
        out, best = [], 1.0
        for acc, offered in zip(self.accepted, self.proposed, strict=True):
            best = min(best, acc)
            out.append((best, offered))
        return out


class DraftBudget:
    """Chooses each decode's draft limit (`limits`) and learns from results (`observe_row`).
    Owns every request's record; a request's record goes when `forget` is called (it
    finished, was aborted or preempted). Reads the step-time predictor, which the scheduler
    feeds (services/scheduler/step_costs.py)."""

    def __init__(self, max_drafts: int, predictor: StepCostPredictor) -> None:
        self._k = max_drafts
        self._predictor = predictor
        self._engine = _Record([1.0] * max_drafts, [PRIOR_ACCEPT] * max_drafts)
        self._by_request: dict[str, _Record] = {}  # rid ->
        self._steps_without = 0
        self._explore_turn = 0
        self._misses = 0  # drafting rows in a row that proposed drafts and had none accepted

    def observe_row(self, req: Request, limit: int, num_proposed: int, num_accepted: int) -> None:
        """Called per drafting row of a result: of up to `limit` drafts, `num_proposed` were
        offered and the first `num_accepted` accepted."""
        record = self._by_request.get(req.rid)
        if record is None:
            engine = self._engine
            record = _Record(list(engine.proposed), list(engine.accepted))
            self._by_request[req.rid] = record
        record.learn(limit, num_proposed, num_accepted, 1 - ACCEPT_DECAY)
        self._engine.learn(limit, num_proposed, num_accepted, 0.01)
        if num_accepted:
            self._misses = 0
        elif num_proposed:
            self._misses += 1

    def forget(self, req: Request) -> None:
        self._by_request.pop(req.rid, None)

    def limits(self, decodes: list[Request], shape: StepShape) -> dict[int, int]:
        """Called once per step by `Speculation.assign` with the step's decodes that may draft
        and the step's shape without drafts. Returns id(request) -> limit (>= 1) for those
        that should draft; the caller still fits each in the budget and blocks."""
        if len(self._by_request) > 4 * len(decodes) + 64:  # finished without a last settle
            live = {r.rid for r in decodes}
            self._by_request = {k: v for k, v in self._by_request.items() if k in live}
        costs = self.draft_cost(shape, len(decodes)) if decodes else None
        if costs is None:  # not measured yet: draft as configured, unless drafts keep missing
            if self._misses < BLIND_MISSES:
                return {id(r): self._k for r in decodes}
            return self._explore(decodes)
        seconds, b = costs
        tokens = float(len(decodes))
        plain_rate = tokens / seconds
        offers = sorted(
            ((p, q, id(r)) for r in decodes for p, q in self._record(r).chances()),
            key=lambda o: -o[0],
        )
        chosen: dict[int, int] = {}
        for p, q, key in offers:
            if p * seconds <= b * tokens:  # an offered draft would lower tokens per second
                break
            chosen[key] = chosen.get(key, 0) + 1
            tokens, seconds = tokens + p * q, seconds + b * q
        if chosen and tokens / seconds >= MIN_GAIN * plain_rate:
            self._steps_without = 0
            return chosen
        return self._explore(decodes)

    def _explore(self, decodes: list[Request]) -> dict[int, int]:
        """A step without drafts: now and then one decode, in turn, tries its k drafts (every
        EXPLORE_EVERY steps, less often while drafts keep missing)."""
        self._steps_without += 1
        every = EXPLORE_EVERY << min(self._misses, MAX_BACKOFF)
        if decodes and self._steps_without >= every:
            self._steps_without = 0
            self._explore_turn += 1
            return {id(decodes[self._explore_turn % len(decodes)]): self._k}
        return {}

    def draft_cost(self, shape: StepShape, num_decodes: int) -> Optional[tuple[float, float]]:
        """(the predicted seconds of a step of `shape`, seconds per draft token of its
        `num_decodes` decodes), None before the predictor's first fit. A draft is never free,
        nor dearer than the step's mean cost per token."""
        seconds = self._predictor.predict(shape)
        if seconds is None or seconds <= 0:
            return None
        mean = seconds / max(shape.num_tokens, 1)
        if not self._predictor.fitted_multi_token_rows:
            return seconds, mean
        drafted = self._predictor.predict(shape.with_drafts([self._k] * num_decodes))
        b = ((drafted or seconds) - seconds) / (self._k * num_decodes)
        return seconds, min(max(b, 1e-6), mean)

    def _record(self, req: Request) -> _Record:
        return self._by_request.get(req.rid, self._engine)
