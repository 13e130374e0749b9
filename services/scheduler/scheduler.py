"""The scheduler core: waiting queue, running batch, KV block pool (and prefix cache), tables.

Pure Python and single-threaded; the process loop (server.py) calls it: `add_request` and
`abort_request` as messages arrive, then `schedule()` -> worker -> `update()` (results.py), one
plan in flight at a time, or two with `async_scheduling` (overlap: plan N+1 is built while step
N runs, assuming every running request goes on; services/scheduler/inflight.py). Invariants
kept after every call: services/scheduler/integrity.py (checked by `check_integrity()`); tokens
per step <= the budget; a request is live (waiting or running) until its one final output has
been returned.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Optional

from services.scheduler.admission import admission_problem
from services.scheduler.batching import BatchingRules
from services.scheduler.block_pool import BlockPool
from services.scheduler.config import SchedulerConfig
from services.scheduler.faults import WorkerFaults
from services.scheduler.inflight import InFlightStep
from services.scheduler.integrity import check_scheduler
from services.scheduler.policy import WaitingQueue, pick_victim
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request, RequestStatus
from services.scheduler.results import StepResults
from services.scheduler.running import RunningSet
from services.scheduler.stats import Counters, StepRecord, step_record
from services.scheduler.steady import SteadyDecodes, SteadyTokens
from services.scheduler.step import BuiltStep, StepBuilder
from shared.protocol.engine_channel import RequestOutput, RequestRejected, SubmitRequest
from shared.protocol.worker_channel import StepPlan

# full passes in a row, all decodes with the batch unchanged, before a steady run starts
STEADY_AFTER = 4


class Scheduler(StepResults, WorkerFaults):
    """The result path (`update()`) is in results.py, the answers to worker faults in
    faults.py."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        clock: Callable[[], float] = time.time,
        cache_namespace: bytes = b"",
    ) -> None:
        """`cache_namespace`: what besides tokens decides the KV (shared/prefix_hash.py
        `cache_namespace(model, dtype)`, from the worker handshake)."""
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
        self._eos_ids = frozenset(eos_token_ids)
        self._clock = clock
        self._rules = BatchingRules.from_config(config)
        self._caching = config.enable_prefix_caching
        self._fresh_state(num_blocks)
        self._reset_faults()  # bisection of failed steps (faults.py)
        self._live: dict[str, Request] = {}  # waiting + running, not finished
        self._inflight: deque[InFlightStep] = deque()  # plans sent, oldest first
        self._step_id = 0
        self._seq_no = 0
        self.counters = Counters()
        self.last_step_record: Optional[StepRecord] = None

    # ---- admission and abort -----------------------------------------------------------------

    def add_request(self, req: SubmitRequest) -> Optional[RequestRejected]:
        """Called for each SubmitRequest; None when queued, else why it was refused."""
        problem = admission_problem(
            req.rid,
            len(req.prompt_token_ids),
            is_duplicate=req.rid in self._live or req.rid in self._batch,
            max_model_len=self.max_model_len,
            kv_capacity=self.pool.num_blocks * self.block_size,
            num_waiting=len(self._waiting),
            max_waiting=self.config.max_waiting,
        )
        if problem is not None:
            self.counters.num_rejected += 1
            return RequestRejected(req.rid, problem[0], problem[1])
        stop_ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids |= self._eos_ids
        self._seq_no += 1
        request = Request(
            rid=req.rid,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.sampling,
            priority=req.priority,
            seq_no=self._seq_no,
            arrival_time=self._clock(),
            max_len=min(self._max_len, len(req.prompt_token_ids) + req.sampling.max_tokens),
            stop_ids=frozenset(stop_ids),
        )
        if self._caching:
            self.prefix_cache.prepare(request)
        self._live[req.rid] = request
        self._waiting.add(request)
        self.counters.num_admitted += 1
        return None

    def abort_request(self, rid: str, reason: str = "abort") -> Optional[RequestOutput]:
        """Idempotent; frees the request's blocks at once. Its final output if it was live.

        `reason` is not sent to the client (the finish reason is "abort"); it is kept on the
        request for logs.
        """
        req = self._live.get(rid)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self._remove_waiting(req)  # the queue, or held aside by bisection (faults.py)
        else:
            self._batch.drop(req)
        self._mark_finished(req, "abort", self._clock())
        req.finish_reason = reason
        return req.output([], [], "abort")

    def _fresh_state(self, num_blocks: int) -> None:
        """An empty pool, prefix cache, waiting queue and batch (start, and after a failure)."""
        config = self.config
        self.pool = BlockPool(num_blocks, self.block_size, config.watermark)
        self.prefix_cache = PrefixCache(self.pool, self._cache_namespace, self._caching)
        self._queue_grown = self.prefix_cache.grown.append  # per decode crossing a block
        self._waiting = WaitingQueue(config.policy, config.max_wait, self.prefix_cache)
        requeue = self._waiting if self._rules.preempts_to_queue else None
        register = self.prefix_cache.register_computed if self._caching else None
        self._batch = RunningSet(self.pool, config.policy, requeue, register)
        self._steady: Optional[SteadyDecodes] = None  # the steady run of decodes, if any
        # (batch version, full passes in a row at it that scheduled every request as a decode)
        self._steady_streak: tuple[Optional[int], int] = (None, 0)
        self._steady_tokens: Optional[SteadyTokens] = None  # update()'s side of it

    def after_plan(self) -> None:
        """Called once the plan has left and the step's outputs were sent, while the worker
        computes: work kept off the result -> plan path (prefix-cache registrations, and
        evicting ahead the cached blocks the next step will allocate)."""
        if self._caching:
            # the most blocks one step can allocate: its tokens' blocks, plus one per request
            # for a partly filled block (decodes: their one token may need a new block)
            config = self.config
            most = -(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs
            self.prefix_cache.after_plan(most)

    def reset_prefix_cache(self) -> int:
        """The `reset_prefix_cache` command: cached blocks become free and no block is findable
        any more (blocks in use stay in use). Returns the number of blocks dropped."""
        return self.prefix_cache.reset()

    # ---- one iteration -----------------------------------------------------------------------

    def schedule(self) -> Optional[StepPlan]:
        """Called while `can_schedule()`. Decides this step; None when nothing can run now.

        Recipe: end a drained static batch; form a new dynamic/static batch if due; fill the
        step (`_fill_step`); if nothing live could run, fill it again letting just-resumed
        requests be preempted too (progress before anti-thrash); build the plan.
        """
        if len(self._inflight) >= self.config.max_plans_in_flight:
            raise RuntimeError("schedule() called with every plan slot in flight")
        now = self._clock()
        if self._rules.keeps_finished_as_padding:
            self._batch.end_static_batch_if_done()
        if self._rules.should_form_batch(now, self._waiting, len(self._batch)):
            self._form_batch(now)
        step = self._fill_step(now, spare_protected=True)
        if not step.has_live and self.has_work():
            first_preemptions = step.num_preemptions
            step = self._fill_step(now, spare_protected=False)
            step.num_preemptions += first_preemptions
        if len(step) == 0:
            self.last_step_record = None
            return None
        self._step_id += 1
        built = step.build(self._step_id, self._batch.worker, self._batch.requests.values())
        self._steady_built(step)
        self.counters.num_preemptions += step.num_preemptions
        for seq in built.plan.new_seqs:
            req = self._live.get(seq.rid)
            if req is not None and req.first_scheduled is None:
                req.first_scheduled = now
        # a steady plan's result may take update()'s fast path (results.py `_apply_steady`)
        steady = built.steady and not built.plan.new_seqs
        steady = steady and not self._rules.keeps_finished_as_padding
        mark = self._batch.num_changes if steady else None
        self._inflight.append(InFlightStep(self._step_id, built.rids, built.sampled,
                                           built.sampled_rids, built.filled, mark,
                                           self._batch.version))  # fmt: skip
        self._record_step(built, step, now)
        return built.plan

    def _fill_step(self, now: float, spare_protected: bool) -> StepBuilder:
        """Give every running decode its token (preempting lower-ranked requests when blocks
        run out); continue running prefills in chunks; then, in continuous mode and if nobody
        was preempted for blocks, admit waiting requests in policy order while slots, budget
        and blocks last (under `priority`, a better waiting request may first take the worst
        one's slot)."""
        self._batch.round += 1
        self._batch.spare_protected = spare_protected
        step = StepBuilder(self.config.max_num_batched_tokens, self.block_size * self._caching)
        prefills = self._schedule_decodes(step)
        self._schedule_running_prefills(step, prefills)
        if self._rules.admits_every_step and step.num_preemptions == 0:
            if self.config.policy == "priority":
                self._make_room_for_priority(step, now)
            self._admit_waiting(step, now)
        return step

    def _schedule_decodes(self, step: StepBuilder) -> list[Request]:
        """Every running decode gets one token; budget always suffices (config guarantees
        max_num_batched_tokens >= max_num_seqs). Only when blocks are out and nobody ranked
        below it holds any does a decode wait a step. Static padding comes after live
        requests. Returns the running requests in prefill, in batch order.

        While the batch is steady (services/scheduler/steady.py) the last step's decodes are
        reused and only the requests due for a check are looked at."""
        if self._steady is not None and self._steady_decodes(step, self._steady):
            return []
        block_size = self.block_size
        padding: list[Request] = []
        prefills: list[Request] = []
        append = step.decodes.append
        for req in list(self._batch.requests.values()):
            computed = req.num_computed_tokens
            if computed < req.prefill_len:
                if req.preempted_at_step != self._batch.round:  # not preempted earlier in this loop
                    prefills.append(req)
                continue
            if req.padding:
                padding.append(req)
                continue
            if (computed == len(req.token_ids) and computed + 1 >= req.max_len) or (
                computed >= len(req.block_ids) * block_size
            ):
                if not self._decode_goes_on(req, step):
                    continue
            append(req)
        for req in padding:
            self._schedule_padding(req, step)
        self._note_steady(step, not prefills and not padding)
        return prefills

    def _decode_goes_on(self, req: Request, step: StepBuilder) -> bool:
        """The two checks of a running decode (not in prefill, not padding): False when the
        sample in flight is its last (length: overlap gives it no extra step) or its table is
        full and no block can be had (nobody ranked below it to take one from: it waits)."""
        computed = req.num_computed_tokens
        if computed == len(req.token_ids) and computed + 1 >= req.max_len:
            return False
        if computed >= len(req.block_ids) * self.block_size:  # its table is full: grow it
            if not self._batch.grow(req, computed + 1, step):
                return False
            if self._caching:  # its decode-filled blocks become findable in after_plan()
                self._queue_grown(req)
        return True

    def _steady_decodes(self, step: StepBuilder, steady: SteadyDecodes) -> bool:
        """The steady run's step: the last step's decodes again, after checking the requests
        due. False (nothing scheduled yet, the run over) when it cannot be reused: the batch
        changed, or a check says a request does not compute this step."""
        if not steady.armed or steady.version != self._batch.version:
            self._steady = None
            return False
        build, due = steady.take_due()
        for req in due:
            if not self._decode_goes_on(req, step) or steady.version != self._batch.version:
                self._steady = None  # a request waits or was preempted: the full pass
                return False
            steady.check_later(req, build)
        step.decodes = list(steady.decodes)
        step.steady_rids = steady.rids
        step.grown = due
        return True

    def _steady_built(self, step: StepBuilder) -> None:
        """The step was built: it continues the steady run if it computed the whole list with
        the batch unchanged (a later preemption in the step, or an admission, ends the run)."""
        steady = self._steady
        if steady is None:
            return
        if steady.version == self._batch.version and len(step.decodes) == len(steady.decodes):
            steady.built()
        else:
            self._steady = None

    def _note_steady(self, step: StepBuilder, all_decode: bool) -> None:
        """After a full pass: a steady run starts once `STEADY_AFTER` passes in a row scheduled
        every running request as a decode with the batch unchanged between them (not in static
        batching, whose finished members stay as padding). Starting one costs a pass over the
        batch: a batch that changes every few steps never pays it."""
        version = self._batch.version
        all_decode = all_decode and len(step.decodes) == len(self._batch)
        if not all_decode or self._rules.keeps_finished_as_padding:
            self._steady_streak = (None, 0)
        elif self._steady_streak[0] != version:
            self._steady_streak = (version, 1)
        elif self._steady_streak[1] + 1 < STEADY_AFTER:
            self._steady_streak = (version, self._steady_streak[1] + 1)
        else:
            self._steady_streak = (None, 0)
            self._steady = SteadyDecodes.start(step.decodes, version, self.block_size)

    def _schedule_padding(self, req: Request, step: StepBuilder) -> None:
        """Static batching computes a finished member while blocks are free; never preempts."""
        if not req.known_to_worker or req.rid not in self._batch:
            return  # evicted: it only holds its slot now
        if len(req.token_ids) >= self._max_len:
            return
        if self._batch.grow_if_free(req, req.num_computed_tokens + 1):
            step.decodes.append(req)

    def _schedule_running_prefills(self, step: StepBuilder, prefills: list[Request]) -> None:
        """Running requests still in prefill get a chunk each, in batch order, while budget
        and blocks last."""
        chunk_size = self.config.chunk_size
        for req in prefills:
            if step.budget_left == 0:
                return
            if (
                req.num_computed_tokens >= req.prefill_len
                or req.padding
                or req.rid not in self._batch
                or req.preempted_at_step == self._batch.round
            ):
                continue  # preempted (or, padding) since the list was made
            # dynamic/static: a member (re)starting looks up its cached prefix first
            fresh = self._caching and not req.block_ids and req.num_computed_tokens == 0
            if fresh and self.prefix_cache.attach_if_room(req, step):
                fresh = False  # a hit, counted
            start = req.num_computed_tokens
            # Room for at least one more token, preempting lower-ranked requests if need be;
            # then the chunk shrinks to what is free rather than preempt for all of it.
            if not self._batch.grow(req, start + 1, step):
                continue  # it waits
            fit = (len(req.block_ids) + self.pool.num_free) * self.block_size - start
            n = min(req.prefill_len - start, chunk_size, step.budget_left, fit)
            self._batch.grow(req, start + n, step)
            step.add_chunk(req, n)
            if fresh:  # a miss, counted once the request is scheduled
                self.prefix_cache.count(req, step)

    def _admit_waiting(self, step: StepBuilder, now: float) -> None:
        """Continuous mode: waiting requests join in policy order. Stops at the first that does
        not fit (no skipping ahead: that is what keeps fcfs fair and aging effective)."""
        admitted: list[Request] = []
        chunk_size = self.config.chunk_size
        cache, pool, bs = self.prefix_cache, self.pool, self.block_size
        for req in self._waiting.ordered(now):
            if len(self._batch) >= self.config.max_num_seqs or step.budget_left == 0:
                break
            hits = cache.lookup(req) if self._caching else []
            num_cached = len(hits) * bs
            n = min(len(req.token_ids) - num_cached, chunk_size, step.budget_left)
            need = pool.blocks_needed(len(hits), num_cached + n)
            # The watermark protects running requests; with none running anyone may start.
            # Cached hits (ref count 0) are taken from the free count too.
            reviving = pool.num_reviving(hits) if hits else 0
            if not pool.can_allocate(need + reviving, keep_watermark=len(self._batch) > 0):
                break
            self._batch.start(req)
            if self._caching:
                cache.attach(req, hits, step)  # before allocating: never evicts its own hits
            blocks = pool.allocate(need)
            assert blocks is not None  # can_allocate said so
            req.block_ids.extend(blocks)
            admitted.append(req)
            step.add_chunk(req, n)
        for req in admitted:
            self._waiting.remove(req)

    def _make_room_for_priority(self, step: StepBuilder, now: float) -> None:
        """Priority policy, all slots taken: a waiting request with a better (lower) priority
        than the worst running one (or an aged one, see policy.py) takes that one's slot, so a
        full batch of low-priority requests cannot hold a high-priority one back (priority
        inversion). One per step; the victim rejoins the queue behind it by its own priority
        (an un-aged victim never outranks an aged head), so they cannot swap back."""
        if len(self._batch) < self.config.max_num_seqs:
            return
        head = next(self._waiting.ordered(now), None)
        if head is None:
            return
        # Aging ranks an aged request before every un-aged one: an aged head may take any
        # un-aged request's slot, and no aged running request is ever a victim here.
        is_aged = self._waiting.is_aged
        running = [r for r in self._batch.requests.values()
                   if not r.padding and not is_aged(r, now)]  # fmt: skip
        victim = pick_victim("priority", running)
        if victim is not None and (is_aged(head, now) or victim.priority > head.priority):
            self._batch.preempt(victim, step)

    def _form_batch(self, now: float) -> None:
        """Dynamic/static: the next batch's members leave the queue together."""
        members: list[Request] = []
        for req in self._waiting.ordered(now):
            if len(members) == self._rules.batch_size:
                break
            members.append(req)
        for req in members:
            self._waiting.remove(req)
            self._batch.start(req)

    # ---- observability -----------------------------------------------------------------------

    def _record_step(self, built: BuiltStep, step: StepBuilder, now: float) -> None:
        num_running = len(self._batch)
        record = step_record(
            built, step, now, len(self._waiting), num_running, self.config.max_num_seqs, self.pool
        )
        self.counters.count_step(record)
        self.last_step_record = record

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
        out.update(self.prefix_cache.stats())
        return out

    @property
    def num_plans_in_flight(self) -> int:
        return len(self._inflight)

    def can_schedule(self) -> bool:
        """True while another plan may be sent before a result arrives (one in flight at most,
        two with async scheduling)."""
        return len(self._inflight) < self.config.max_plans_in_flight

    def is_live(self, rid: str) -> bool:
        """True while `rid` waits or runs (not yet finished or aborted)."""
        return rid in self._live

    def has_work(self) -> bool:
        """True while anything waits or runs (static padding included)."""
        return bool(self._live) or len(self._batch) > 0

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant is broken. O(total blocks): tests only."""
        check_scheduler(self, self._live.values(), self._waiting, self._batch)
