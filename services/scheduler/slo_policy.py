"""`--policy slo`: admission and ordering by latency targets (docs/design/scheduler.md, "The slo
policy"). One object, asked at three points of the scheduler's recipe:

* **on arrival** (`Scheduler.add_request` -> `on_arrival`): the request's TTFT is predicted
  (the prompt tokens ahead of it: the running prefills' rest, the waiting requests ahead in
  deadline order, its own; over the prompt tokens per second measured while requests waited)
  and so is its lone decode step against its TPOT target. Out of reach: refused at once with
  `slo_unattainable` when it asked `on_slo_miss: "reject"`, else served best-effort (after
  every request that can still make its targets). A resumed request (earlier outputs, or
  `attempt` > 0) is never refused. The decision is made here, before any waiting, and never
  revisited.
* **the waiting order** (policy.py `WaitingQueue`, key `sort_key`): earliest TTFT deadline
  first (least slack), best-effort requests after all others, by arrival; a request without a
  TTFT target has the aging bound as its deadline. Aging is the rule of every sorted policy:
  a request that waited `max_wait` goes before all un-aged ones.
* **each step** (fill.py): `begin_step` caps the step's token budget so that the predicted step
  time stays within the tightest TPOT target among the running requests, and `may_admit` stops
  admissions whose extra decode row would break it: running requests are protected before new
  prefills are admitted. An aged request skips that check (only slots, budget and blocks hold
  it back), so aging still bounds every wait; so does an empty batch.

Predictions come from the step-time predictor the scheduler fits online (shared/step_cost.py);
before its first fit the policy predicts nothing out of reach and caps nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional

from services.scheduler.request import Request
from services.scheduler.slo_classes import SloTargets, resolve_targets
from shared.protocol.client_channel.targets import TTFT_HEADROOM
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.step_cost import StepCostPredictor, StepShape

# Steps kept for the admission rate: those that began with requests waiting (the rate is then
# the engine's, not the arrivals'); ~1-5 s of steps on the simulated H200.
RATE_WINDOW_STEPS = 256
# The step time aimed at is this share of the tightest TPOT: room for the predictor's error
# and the step-time noise (a few %), and for the prefill chunks that lengthen some gaps.
TPOT_HEADROOM = 0.9


@dataclass(frozen=True, slots=True)
class ArrivalDecision:
    """What `on_arrival` decided for an admitted request."""

    ttft_deadline: float  # scheduler clock; the aging bound for a request without a target
    tpot_s: Optional[float]
    best_effort: bool


def sort_key(req: Request) -> tuple[float, float]:
    """The waiting order's key under slo: reachable requests by deadline, then best-effort."""
    if req.best_effort:
        return (1.0, req.arrival_time)
    return (0.0, req.ttft_deadline if req.ttft_deadline is not None else req.arrival_time)


class SloPolicy:
    def __init__(
        self, predictor: StepCostPredictor, max_wait: float, max_num_seqs: int, chunk_size: int
    ) -> None:
        self._predictor = predictor
        self._max_wait = max_wait
        self._max_num_seqs = max_num_seqs
        self._chunk_size = chunk_size
        # the running batch as of the last step: rows, cached tokens, tightest TPOT target (s)
        self._num_rows = 0
        self._context = 0
        self._tightest: Optional[float] = None
        self._prompt_left = 0  # prompt tokens the running prefills still need, as of that step
        self._prompt_budget = chunk_size  # prompt tokens the last step could take beside decodes
        # capacity-limited steps: (seconds since the previous step, requests admitted, prompt
        # tokens scheduled)
        self._steps: deque[tuple[float, int, int]] = deque(maxlen=RATE_WINDOW_STEPS)
        self._last_step_at: Optional[float] = None
        self._backlogged = False  # the last fill left requests waiting
        self.num_refused = 0
        self.num_best_effort = 0

    # ---- arrival -------------------------------------------------------------------------

    def on_arrival(
        self,
        prompt_len: int,
        targets: SloTargets,
        resumed: bool,
        now: float,
        waiting: Iterable[Request],
    ) -> tuple[Optional[ArrivalDecision], Optional[tuple[str, str]]]:
        """(the decision, None) for a request to queue, or (None, (code, message)) to refuse.
        Called once per request, before it is queued; `waiting`: the waiting requests."""
        deadline = now + (targets.ttft_ms / 1000.0 if targets.ttft_ms else self._max_wait)
        tpot_s = targets.tpot_ms / 1000.0 if targets.tpot_ms else None
        miss = self._predicted_miss(prompt_len, targets, deadline, now, waiting)
        if miss is None or resumed:
            return ArrivalDecision(deadline, tpot_s, best_effort=miss is not None), None
        if targets.on_slo_miss == "reject":
            self.num_refused += 1
            return None, (ErrorCode.SLO_UNATTAINABLE, miss)
        self.num_best_effort += 1
        return ArrivalDecision(deadline, tpot_s, best_effort=True), None

    def _predicted_miss(
        self,
        prompt_len: int,
        targets: SloTargets,
        deadline: float,
        now: float,
        waiting: Iterable[Request],
    ) -> Optional[str]:
        """Why the targets are predicted out of reach, or None."""
        if targets.tpot_ms is not None:
            lone = self._predictor.predict(_decode_shape(1, prompt_len))
            if lone is not None and lone * 1000.0 > targets.tpot_ms:
                return f"a decode step is predicted at {lone * 1000.0:.0f} ms > tpot_ms"
        if targets.ttft_ms is None:
            return None
        ttft = self.predicted_ttft(prompt_len, deadline, now, waiting)
        if ttft is not None and ttft * 1000.0 > targets.ttft_ms * TTFT_HEADROOM:
            return f"time to first token predicted at {ttft * 1000.0:.0f} ms > ttft_ms"
        return None

    def predicted_ttft(
        self, prompt_len: int, deadline: float, now: float, waiting: Iterable[Request]
    ) -> Optional[float]:
        """Seconds until a new request's first token: the prompt tokens ahead of it (the
        running prefills' rest, the reachable waiting requests with an earlier deadline) and
        its own, at the prompt tokens per second measured while requests waited (a rate of
        requests would miss by the spread of prompt lengths: 32-512 tokens in the mixed
        workload), plus a slot's wait when the batch is full. Before any backlog was measured:
        the prompts at the predicted step time, `_prompt_budget` tokens a step."""
        ahead = [r for r in waiting if not r.best_effort and sort_key(r)[1] <= deadline]
        work = self._prompt_left + sum(len(r.token_ids) for r in ahead) + prompt_len
        slot_s = 0.0
        if self._num_rows >= self._max_num_seqs:
            rate = self.admission_rate()
            slot_s = math.inf if rate == 0 else 1.0 / rate if rate is not None else 0.0
        token_rate = self.prompt_token_rate()
        if token_rate is not None:
            return slot_s + (math.inf if token_rate == 0 else work / token_rate)
        chunk = max(1, min(self._chunk_size, self._prompt_budget, work))
        step = self._predictor.predict(self._mixed_shape(chunk))
        if step is None:
            return None
        return slot_s + math.ceil(work / chunk) * step

    def admission_rate(self) -> Optional[float]:
        """Requests admitted per second while requests were left waiting; None before any."""
        span = sum(dt for dt, _, _ in self._steps)
        if span <= 0:
            return None
        return sum(n for _, n, _ in self._steps) / span

    def prompt_token_rate(self) -> Optional[float]:
        """Prompt tokens scheduled per second while requests were left waiting; None before
        any such interval."""
        span = sum(dt for dt, _, _ in self._steps)
        if span <= 0:
            return None
        return sum(n for _, _, n in self._steps) / span

    def route_report(self, waiting: Iterable[Request]) -> dict[str, float]:
        """What the frontends' routers read with this engine's load (EngineReady, once per
        heartbeat; services/tokenizer/router_targets.py): the predicted wait of a request
        arriving now before its own prompt (`slo_queue_s`), the admission rate and prompt
        tokens per second behind it, and the decode step a new row would join. A figure not
        known yet (no fit, no backlog seen) is left out."""
        out: dict[str, float] = {}
        queue_s = self.predicted_ttft(0, math.inf, 0.0, waiting)
        if queue_s is not None and math.isfinite(queue_s):
            out["slo_queue_s"] = queue_s
        rate = self.admission_rate()
        if rate is not None and rate > 0:
            out["slo_admission_rate"] = rate
        rows, context = self._num_rows, self._context
        step = self._predictor.predict(_decode_shape(rows + 1, context + context // max(rows, 1)))
        if step is not None:
            out["slo_decode_step_s"] = step
        token_rate = self.prompt_token_rate()
        if token_rate is None:
            chunk = self._predictor.predict(self._mixed_shape(self._prompt_budget))
            token_rate = None if not chunk else self._prompt_budget / chunk
        if token_rate:
            out["slo_prefill_tokens_per_s"] = token_rate
        return out

    # ---- each step ---------------------------------------------------------------------------

    def begin_step(self, running: Iterable[Request], token_budget: int) -> int:
        """Called at the start of each forward's fill with the running requests: notes the
        batch and returns the token budget that keeps the predicted step within the tightest
        TPOT target (never below one token per running request). O(running)."""
        rows = context = prompt_left = 0
        tightest: Optional[float] = None
        for r in running:
            rows += 1
            context += r.num_computed_tokens
            prompt_left += max(r.prefill_len - r.num_computed_tokens, 0)
            if r.tpot_s is not None and (tightest is None or r.tpot_s < tightest):
                tightest = r.tpot_s
        self._num_rows, self._context, self._tightest = rows, context, tightest
        self._prompt_left, self._prompt_budget = prompt_left, max(token_budget - rows, 1)
        if tightest is None or self._predictor.predict(self._mixed_shape(0)) is None:
            return token_budget
        limit = tightest * TPOT_HEADROOM
        lo, hi = 0, max(token_budget - rows, 0)  # prompt tokens beside the decodes
        while lo < hi:  # the largest chunk whose step is predicted within `limit`
            mid = (lo + hi + 1) // 2
            t = self._predictor.predict(self._mixed_shape(mid))
            if t is not None and t <= limit:
                lo = mid
            else:
                hi = mid - 1
        self._prompt_budget = max(lo, 1)
        return max(rows + lo, rows, 1)

    def may_admit(self, req: Request, num_running: int) -> bool:
        """Whether admitting `req` (not aged) keeps the predicted decode step within the
        tightest TPOT target, its own included. Called in admission order; an empty batch
        always admits."""
        if num_running == 0:
            return True
        targets = [t for t in (self._tightest, req.tpot_s) if t is not None]
        if not targets:
            return True
        shape = _decode_shape(self._num_rows + 1, self._context + len(req.token_ids))
        t = self._predictor.predict(shape)
        return t is None or t <= min(targets) * TPOT_HEADROOM

    def end_step(
        self, now: float, num_admitted: int, num_waiting: int, num_prompt_tokens: int
    ) -> None:
        """Called after each fill's admissions with the prompt tokens the step holds (and those
        its admitted requests found in the prefix cache: whole prompts are what waits): the
        interval since the previous fill counts towards the rates when that fill left requests
        waiting (a backlog: what was admitted since is the engine's rate, not the arrivals').
        Counting by the state at the interval's start, not its end, keeps the fill that
        empties the queue in the sample."""
        last, self._last_step_at = self._last_step_at, now
        backlogged, self._backlogged = self._backlogged, num_waiting > 0
        if backlogged and last is not None and now > last:
            self._steps.append((now - last, num_admitted, num_prompt_tokens))

    def _mixed_shape(self, chunk: int) -> StepShape:
        """The running batch's decodes plus one prompt chunk of `chunk` tokens from 0."""
        rows, context = self._num_rows, self._context
        return StepShape(
            num_rows=rows + (chunk > 0),
            num_tokens=rows + chunk,
            num_sampled=rows,
            attention_pairs=context + rows + chunk * (chunk + 1) // 2,
            kv_tokens=context + 2 * (rows + chunk),
            has_chunk=chunk > 1,
        )


def check_arrival(
    req: SubmitRequest,
    classes: dict[str, SloTargets],
    default_class: Optional[str],
    slo: Optional[SloPolicy],
    waiting: Callable[[], Iterable[Request]],
    now: float,
) -> tuple[Optional[ArrivalDecision], Optional[tuple[str, str]]]:
    """Called by `Scheduler.add_request` for a request that passed the other checks: its
    targets (slo_classes.py) and, under --policy slo, whether they can be met. (the decision,
    None), or (None, why it is refused). `waiting`: the queue in its order, read only here."""
    targets = resolve_targets(req, classes, default_class)
    if targets is None:
        return None, (ErrorCode.INVALID_PARAMS, f"unknown slo_class {req.slo_class!r}")
    if slo is None:
        return None, None
    resumed = req.attempt > 0 or bool(req.output_token_ids)
    return slo.on_arrival(len(req.prompt_token_ids), targets, resumed, now, waiting())


def _decode_shape(rows: int, context: int) -> StepShape:
    """A decode-only step of `rows` rows over `context` cached tokens in all."""
    return StepShape(rows, rows, rows, context + rows, context + 2 * rows, False)
