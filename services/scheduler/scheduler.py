"""The scheduler core: one object (`Scheduler`) made of parts, each the one owner of its state.

Pure Python and single-threaded; the process loop (server.py) calls it: `add_request` and
`abort_request` as messages arrive, then `schedule()` -> worker -> `update()`, one plan in
flight at a time, or two with `async_scheduling` (overlap: plan N+1 is built while step N runs,
assuming every running request goes on; services/scheduler/inflight.py).

The parts, built by `_assemble` with their dependencies passed in (map: docs/design/scheduler.md):
`live` (live.py); the waiting queue (policy.py), running set (running.py), block pool and prefix
cache; `in_flight` (inflight.py, read by the loop too); the step filler (fill.py), asked by
`schedule()`, with the `composition` (composition.py), `speculation` (speculation.py) and `slo`
(slo_policy.py) policies; the result applier (results.py, `update()`); `steady` (steady.py, the
steady-decode fast path); `faults` (faults.py); `leases` / `pulls` (handover.py, KV hand-overs).

Invariants kept after every call, each checked by its owner's read-only `check_invariants()`
(composed by `check_invariants()` here; tests call it after every step): tokens per step <= the
budget; a request is live (waiting or running) until its one final output has been returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

from services.scheduler.admission import admission_problem
from services.scheduler.batching import BatchingRules
from services.scheduler.block_pool import BlockPool
from services.scheduler.composition import composition_for
from services.scheduler.config import SchedulerConfig
from services.scheduler.faults import Bisection, requeue_after_loss
from services.scheduler.fill import StepFiller
from services.scheduler.handover import Admission, Leases, Pulls
from services.scheduler.inflight import InFlightStep, InFlightSteps
from services.scheduler.live import LiveRequests
from services.scheduler.policy import WaitingQueue
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import RequestStatus
from services.scheduler.results import ResultApplier
from services.scheduler.running import RunningSet
from services.scheduler.slo_policy import ArrivalDecision, SloPolicy, check_arrival
from services.scheduler.speculation import SpecCounters, Speculation
from services.scheduler.stats import Counters, step_record
from services.scheduler.steady import SteadyDecodes
from services.scheduler.step import StepBuilder
from services.scheduler.step_costs import SAMPLED_EVERY, StepCosts
from services.scheduler.tracing import SchedulerTrace
from shared.protocol.engine_channel import (
    OutputBatch,
    RequestOutput,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import KvPulled, StepPlan, StepResult
from shared.step_cost import StepCostPredictor


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        clock: Callable[[], float] = time.time,
        cache_namespace: bytes = b"",
        speculative: bool = False,
        trace: Optional[SchedulerTrace] = None,
        shape_every: Optional[int] = None,
    ) -> None:
        """`cache_namespace`: what besides tokens decides the KV (shared/prefix_hash.py
        `cache_namespace(model, dtype)`, from the worker handshake). `speculative`: the worker
        proposes drafts (its handshake says so); decodes then get draft limits
        (speculation.py) unless `num_speculative_tokens` is 0. `trace`: where traced
        requests' spans go (None: tracing off). `shape_every`: the predictor learns from one
        step in this many (None: every step where a policy asks it, else SAMPLED_EVERY)."""
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 (one prompt token and one output)")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._cache_namespace = cache_namespace
        # A request alone may fill the whole pool: num_blocks * block_size computed positions,
        # plus its last sampled token, which is never computed. Past that it ends as "length"
        # instead of preempting itself forever.
        self._max_len = min(max_model_len, num_blocks * block_size + 1)
        self._clock = clock
        self._rules = BatchingRules.from_config(config)
        # static batching computes finished members on as padding from the positions the
        # scheduler knows, which accepted drafts in flight would have moved: it never drafts
        self._speculative = (speculative and config.num_speculative_tokens > 0
                             and not self._rules.keeps_finished_as_padding)  # fmt: skip
        self._spec_counters = SpecCounters()
        self.counters = Counters()
        self._trace = trace
        self.live = LiveRequests(eos_token_ids, self._max_len, self.counters, trace)
        self.in_flight = InFlightSteps(config.max_plans_in_flight)
        # step time from its shape, fitted from this engine's own steps (shared/step_cost.py)
        self.predictor = StepCostPredictor()
        self._slo_classes = config.slo_class_targets
        self.slo: Optional[SloPolicy] = None
        if config.policy == "slo":
            self.slo = SloPolicy(self.predictor, config.max_wait, config.max_num_seqs,
                                 config.chunk_size)  # fmt: skip
        asked = self.slo is not None or self._speculative  # a policy reads the predictor
        self.step_costs = StepCosts(self.predictor, shape_every or (1 if asked else SAMPLED_EVERY))
        self._step_id = 0
        self._assemble(num_blocks)

    def _assemble(self, num_blocks: int) -> None:
        """An empty pool, prefix cache, waiting queue and batch, and the parts over them (at
        start, and when the worker was lost: its KV is gone)."""
        config, rules, caching = self.config, self._rules, self.config.enable_prefix_caching
        self.pool = BlockPool(num_blocks, self.block_size, config.watermark)
        self.prefix_cache = PrefixCache(self.pool, self._cache_namespace, caching)
        self._waiting = WaitingQueue(config.policy, config.max_wait, self.prefix_cache)
        requeue = self._waiting if rules.preempts_to_queue else None
        register = self.prefix_cache.register_computed if caching else None
        self._batch = RunningSet(self.pool, config.policy, requeue, register)
        self.steady = SteadyDecodes(
            self._batch, self.block_size, enabled=not rules.keeps_finished_as_padding
        )
        cache, waiting, batch, steady = self.prefix_cache, self._waiting, self._batch, self.steady
        self.speculation: Optional[Speculation] = None
        if self._speculative:
            self.speculation = Speculation(batch, config.num_speculative_tokens, self.block_size,
                                           self._spec_counters, self.predictor)  # fmt: skip
        self.composition = composition_for(
            config.step_composition, config.max_num_batched_tokens, config.max_prefill_chunks
        )
        self._filler = StepFiller(
            config, rules, waiting, batch, self.pool, cache, steady, self.composition,
            self._max_len, self.speculation, self.slo,
        )  # fmt: skip
        # a KV hand-over's two sides (handover.py): leases (prefill), pulls (decode)
        self.leases = Leases(self.pool, config.lease_timeout_s, self._clock)
        self.pulls = Pulls(self.pool, cache)
        self._results = ResultApplier(
            self.live, batch, cache, self.in_flight, steady, rules, self.counters, self._clock,
            self.leases, self.speculation,
        )  # fmt: skip
        self.faults = Bisection(
            self.live, waiting, batch, cache, self.in_flight, rules, config.async_scheduling,
            self._clock,
        )  # fmt: skip

    # ---- admission and abort -----------------------------------------------------------------

    def add_request(self, req: SubmitRequest) -> Optional[RequestRejected]:
        """Called for each SubmitRequest; None when queued, else why it was refused."""
        problem = admission_problem(
            req.rid,
            len(req.prompt_token_ids) + len(req.output_token_ids),
            is_duplicate=req.rid in self.live or req.rid in self._batch,
            max_model_len=self.max_model_len,
            kv_capacity=self.pool.num_blocks * self.block_size,
            num_waiting=len(self._waiting),
            max_waiting=self.config.max_waiting,
        )
        if problem is None and len(req.output_token_ids) >= req.sampling.max_tokens:
            problem = (ErrorCode.INVALID_PARAMS, "the resumed request has max_tokens already")
        if problem is None and req.rid in self.pulls:
            problem = (ErrorCode.DUPLICATE_ID, f"request {req.rid!r} is already live")
        now = self._clock()
        decision = None
        if problem is None:
            decision, problem = check_arrival(
                req, self._slo_classes, self.config.slo_default_class, self.slo,
                lambda: self._waiting.ordered(now), now,
            )  # fmt: skip
        if problem is not None:
            self.counters.num_rejected += 1
            return RequestRejected(req.rid, problem[0], problem[1])
        if req.kv_source is not None and self.pulls.start(req, decision):
            return None  # admitted once its KV is here (pull_done), with these targets
        self._admit(req, decision)
        return None

    def _admit(self, req: SubmitRequest, decision: Optional[ArrivalDecision] = None) -> None:
        request = self.live.admit(req, self._clock())
        if decision is not None:
            request.set_targets(decision.ttft_deadline, decision.tpot_s, decision.best_effort)
        self.prefix_cache.prepare(request)
        self._waiting.add(request)
        self.counters.num_admitted += 1
        self.counters.num_resumptions_admitted += req.attempt > 0

    def pull_done(self, msg: KvPulled) -> None:
        """The worker's answer to a PullKv: the request is admitted (its pulled blocks are a
        prefix-cache hit, or it recomputes); its HandoverDone waits in `pulls.take_done`."""
        admission = self.pulls.finish(msg)
        if admission is not None:
            self._admit(*admission)

    def take_worker_messages(self) -> list[Any]:
        """What the hand-over must tell the worker (GrantLease, EndLease, PullKv), in order;
        the loop sends it before the next plan."""
        return [*self.leases.take_messages(), *self.pulls.take_messages()]

    def abort_request(self, rid: str, reason: str = "abort") -> Optional[RequestOutput]:
        """Idempotent; frees the request's blocks at once. Its final output if it was live.

        `reason` is not sent to the client (the finish reason is "abort"); it is kept on the
        request for logs.
        """
        req = self.live.get(rid)
        if req is None:
            return RequestOutput(rid, [], "abort") if self.pulls.cancel(rid) else None
        if req.status is RequestStatus.WAITING:
            self.faults.remove_waiting(req)  # the queue, or held aside by bisection
        else:
            self._batch.drop(req)
        self.live.finish(req, "abort", self._clock(), kept_reason=reason)
        return req.output([], [], "abort")

    # ---- one iteration -----------------------------------------------------------------------

    def schedule(self) -> Optional[StepPlan]:
        """Called while `can_schedule()`. Decides this step and records it in flight; None when
        nothing can run now.

        Recipe: end a drained static batch; form a new dynamic/static batch if due; fill the
        step (fill.py); if nothing live could run, fill it again letting just-resumed requests
        be preempted too (progress before anti-thrash); build the plan.
        """
        if not self.in_flight.has_room():
            raise RuntimeError("schedule() called with every plan slot in flight")
        now = self._clock()
        if self._rules.keeps_finished_as_padding:
            self._batch.end_static_batch_if_done()
        if self._rules.should_form_batch(now, self._waiting, len(self._batch)):
            self._filler.form_batch(now)
        step = self._filler.fill(now, spare_protected=True)
        if not step.has_live and self.has_work():
            first_preemptions = step.num_preemptions
            step = self._filler.fill(now, spare_protected=False)
            step.num_preemptions += first_preemptions
        if len(step) == 0:
            return None
        return self._build(step, now)

    def _build(self, step: StepBuilder, now: float) -> StepPlan:
        """The filled step becomes a plan, recorded in flight with its step record."""
        self._step_id += 1
        shape = self.step_costs.shape(self._step_id, step)  # before build() moves counts
        built = step.build(self._step_id, self._batch.worker, self._batch.requests.values())
        steady = self.steady.after_build(step, built)
        self.composition.built(len(step.decodes), step.num_chunks)
        self.counters.num_preemptions += step.num_preemptions
        for seq in built.plan.new_seqs:
            req = self.live.get(seq.rid)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = now
        predicted = self.predictor.predict(shape) if shape is not None else None
        record = step_record(built, step, now, len(self._waiting), len(self._batch),
                             self.config.max_num_seqs, self.pool, shape, predicted)  # fmt: skip
        self.counters.count_step(record)
        self.in_flight.add(InFlightStep(built.plan, record, built.sampled, built.sampled_rids,
                                        built.filled, self._batch.version, steady,
                                        built.drafts, shape))  # fmt: skip
        return built.plan

    def update(self, result: StepResult, step_s: Optional[float] = None) -> OutputBatch:
        """Called with the oldest in-flight plan's result (results.py `ResultApplier.update`);
        the step's time (`step_s`: the loop's measure) feeds the predictor (step_costs.py)."""
        flight = self.in_flight.oldest()
        if flight is not None:
            self.step_costs.observe(flight, result, step_s)
        return self._results.update(result)

    def after_plan(self) -> None:
        """Called once the plan has left and the step's outputs were sent, while the worker
        computes: work kept off the result -> plan path (prefix-cache registrations, evicting
        ahead the cached blocks the next step will allocate, traced requests' spans)."""
        if self._trace is not None:
            self._trace.flush()
        self.step_costs.after_plan()
        if self.config.enable_prefix_caching:
            # the most blocks one step can allocate: its tokens' blocks, plus one per request
            # for a partly filled block (decodes: their one token may need a new block)
            config = self.config
            most = -(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs
            self.prefix_cache.after_plan(most)

    def reset_prefix_cache(self) -> int:
        """The `reset_prefix_cache` command: cached blocks become free and no block is findable
        any more (blocks in use stay in use). Returns the number of blocks dropped."""
        return self.prefix_cache.reset()

    # ---- worker faults -----------------------------------------------------------------------

    def bisect_failed_step(self, code: str, message: str) -> list[RequestOutput]:
        """The worker failed the oldest step in flight (faults.py `Bisection`)."""
        return self.faults.bisect_failed_step(code, message)

    def step_completed(self, rids: Iterable[str]) -> None:
        """Called by the loop with the rids of each step whose result arrived (bisection)."""
        self.faults.step_completed(rids)

    def release_held_if_idle(self) -> None:
        """Called by the loop before schedule() (bisection)."""
        self.faults.release_held_if_idle()

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """The worker is lost for good: every live request ends with an error; the parts start
        afresh (a new pool: the prefix cache is empty)."""
        now = self._clock()
        outputs = []
        for req in self.live:
            self.live.finish(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
        for submit, _ in self._start_afresh():
            outputs.append(RequestOutput(submit.rid, [], "error", error_code=code,
                                         error_message=message))  # fmt: skip
        return outputs

    def requeue_all(self, max_retries: int, code: str, message: str) -> list[RequestOutput]:
        """The worker is lost with all its state: every request it held restarts from the
        waiting queue by recompute (its generated tokens kept, so no token is sent twice),
        unless it already restarted `max_retries` times: then it ends with `code`. Waiting
        requests keep their places. The pool starts empty (the new worker's is), and so does
        the prefix cache; the first plan resets the worker's batch (a worker that only
        reconnected still holds the old one)."""
        live = sorted(self.live, key=lambda r: r.seq_no)
        pulling = self._start_afresh()  # their KV went with the worker: they recompute
        outputs = requeue_after_loss(live, self._waiting, self.live, max_retries, code, message,
                                     self._clock())  # fmt: skip
        for submit, decision in pulling:
            self._admit(submit, decision)
        return outputs

    def _start_afresh(self) -> list[Admission]:
        """No plan in flight, new empty parts (the worker's KV is gone); returns the requests
        whose KV pull was cut off (their HandoverDone stay queued for their frontends)."""
        pulling = self.pulls.drop_all()
        done = self.pulls.take_done()
        self.in_flight.clear()
        self._assemble(self.pool.num_blocks)
        self.pulls.keep_done(done)
        return pulling

    # ---- observability -----------------------------------------------------------------------

    def next_timeout(self) -> Optional[float]:
        """Seconds until a timer may change what schedule() does (a partial batch forming)."""
        return self._rules.next_timeout(self._clock(), self._waiting, len(self._batch))

    def stats(self) -> dict[str, float]:
        """Gauges now and counters since start, for the stats reply and /metrics."""
        out: dict[str, float] = {
            "num_waiting": len(self._waiting),
            "num_running": len(self._batch),
            "batch_utilization": len(self._batch) / self.config.max_num_seqs,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_usage": self.pool.num_used / self.pool.num_blocks,
            "prefix_caching": float(self.config.enable_prefix_caching),
        }
        out.update(self.counters.as_stats())
        if self.slo is not None:
            out.update(num_slo_refused=self.slo.num_refused,
                       num_slo_best_effort=self.slo.num_best_effort)  # fmt: skip
            out.update(self.slo.route_report(self._waiting.ordered(self._clock())))
        for part in (self.prefix_cache.stats(), self._spec_counters.as_stats(),
                     self.leases.stats(), self.pulls.stats(), self.step_costs.stats()):  # fmt: skip
            out.update(part)
        return out

    def can_schedule(self) -> bool:
        """True while another plan may be sent before a result arrives (one in flight at most,
        two with async scheduling)."""
        return self.in_flight.has_room()

    def is_live(self, rid: str) -> bool:
        """True while `rid` waits or runs (not yet finished or aborted)."""
        return rid in self.live or rid in self.pulls

    def has_work(self) -> bool:
        """True while anything waits or runs (static padding included)."""
        return len(self.live) > 0 or len(self._batch) > 0

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of a part is broken. Read-only; O(total
        blocks): tests call it after every step."""
        running = list(self._batch.requests.values())
        caching = self.config.enable_prefix_caching
        tables = [r.block_ids for r in running] + self.leases.tables() + self.pulls.tables()
        self.pool.check_invariants(tables, shared_ok=caching)
        self.prefix_cache.check_invariants(running)
        self._waiting.check_invariants()
        self._batch.check_invariants(self.config.max_num_seqs, self.block_size)
        self.steady.check_invariants()
        self.composition.check_invariants()
        self.faults.check_invariants()
        self.live.check_invariants(self._waiting, self._batch, self.faults.is_held,
                                   self.faults.num_held)  # fmt: skip
        assert len(self.in_flight) <= self.config.max_plans_in_flight
