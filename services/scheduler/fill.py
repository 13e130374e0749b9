"""Filling one step: which running decodes, running prefill chunks and waiting requests compute,
within the token budget, the batch's slots and the KV blocks (preempting by policy when blocks
run out). `StepFiller.fill` is called by `schedule()` once or twice per step; it changes the
running set, the waiting queue and the block pool only through their methods.

What one forward may hold is the step composition's answer (composition.py `Forward`: decodes,
prompts, or both, its budget and chunk limit); `fill` tries the kinds it offers in order and
keeps the first that schedules anything. Order of a pass: every running decode gets its token
(static padding last); running prefills continue in chunks, in batch order; then, in continuous
mode and if nobody was preempted for blocks, waiting requests are admitted in policy order
while slots, budget and blocks last (under `priority`, a better waiting request may first take
the worst one's slot); last, with speculation, decodes get draft limits from the token budget
and free blocks the prompts left (drafts never delay a prefill, never preempt).
"""

from __future__ import annotations

from typing import Optional

from services.scheduler.batching import BatchingRules
from services.scheduler.block_pool import BlockPool
from services.scheduler.composition import Forward, StepComposition
from services.scheduler.config import SchedulerConfig
from services.scheduler.policy import WaitingQueue, pick_victim
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request
from services.scheduler.running import RunningSet
from services.scheduler.slo_policy import SloPolicy
from services.scheduler.speculation import Speculation
from services.scheduler.steady import SteadyDecodes
from services.scheduler.step import StepBuilder


class StepFiller:
    def __init__(
        self,
        config: SchedulerConfig,
        rules: BatchingRules,
        waiting: WaitingQueue,
        batch: RunningSet,
        pool: BlockPool,
        cache: PrefixCache,
        steady: SteadyDecodes,
        composition: StepComposition,
        max_len: int,
        speculation: Optional[Speculation] = None,
        slo: Optional[SloPolicy] = None,
    ) -> None:
        """`max_len`: what max_model_len and the whole KV pool allow one request.
        `speculation`: gives decodes draft limits (None: the worker does not speculate). `slo`:
        the slo policy (policy slo only), asked for the step's budget and each admission."""
        self._config = config
        self._composition = composition
        self._rules = rules
        self._waiting = waiting
        self._batch = batch
        self._pool = pool
        self._cache = cache
        self._caching = cache.enabled
        self._steady = steady
        self._max_len = max_len
        self._block_size = pool.block_size
        self._speculation = speculation
        self._slo = slo

    def fill(self, now: float, spare_protected: bool) -> StepBuilder:
        """The step: the first kind of forward the composition offers that schedules anything
        (the last one tried, empty, when none does). `spare_protected` False lets just-resumed
        requests be preempted too (schedule()'s second pass, when nothing live could run)."""
        forwards = self._composition.forwards()
        step = self._fill_forward(now, spare_protected, forwards[0])
        for forward in forwards[1:]:  # none under `mixed`
            if len(step):
                break
            num_preemptions = step.num_preemptions
            step = self._fill_forward(now, spare_protected, forward)
            step.num_preemptions += num_preemptions
        return step

    def _fill_forward(self, now: float, spare_protected: bool, forward: Forward) -> StepBuilder:
        """One pass over what `forward` may hold (see the module docstring)."""
        self._batch.begin_pass(spare_protected)
        budget = forward.token_budget
        if self._slo is not None:  # running requests' TPOT targets first
            budget = min(budget, self._slo.begin_step(self._batch.requests.values(), budget))
        step = StepBuilder(budget, self._block_size * self._caching, forward.max_chunks)
        spec = self._speculation if forward.decodes else None
        if forward.decodes:
            prefills = self._schedule_decodes(step)
            if step.grown:  # before any lookup below, which may need their blocks
                self._cache.queue_grown(step.grown)
            if spec is not None:  # decodes with drafts in flight: checked counting them
                spec.check_in_flight(step, self._decode_goes_on)
        else:
            prefills = self._running_prefills()
        if forward.prompts:
            self._schedule_running_prefills(step, prefills)
            if self._rules.admits_every_step and step.num_preemptions == 0:
                if self._config.policy == "priority":
                    self._make_room_for_priority(step, now)
                self._admit_waiting(step, now)
        if spec is not None:  # drafts take what the prompts left: they never delay a prefill
            spec.assign(step)
        return step

    def _running_prefills(self) -> list[Request]:
        """The running requests in prefill, in batch order (a forward without decodes); none
        while a steady run holds the unchanged batch (every one of them decodes)."""
        if self._steady.covers_batch:
            return []
        return [r for r in self._batch.requests.values() if r.num_computed_tokens < r.prefill_len]

    def _schedule_decodes(self, step: StepBuilder) -> list[Request]:
        """Every running decode gets one token; budget always suffices (config guarantees
        max_num_batched_tokens >= max_num_seqs). Only when blocks are out and nobody ranked
        below it holds any does a decode wait a step. Static padding comes after live
        requests. Returns the running requests in prefill, in batch order.

        While the batch is steady (services/scheduler/steady.py) the last step's decodes are
        reused and only the requests due for a check are looked at."""
        if self._steady.fill(step, self._decode_goes_on):
            return []
        block_size, round_no = self._block_size, self._batch.round
        padding: list[Request] = []
        prefills: list[Request] = []
        append = step.decodes.append
        for req in list(self._batch.requests.values()):
            computed = req.num_computed_tokens
            if computed < req.prefill_len:
                if req.preempted_at_step != round_no:  # not preempted earlier in this loop
                    prefills.append(req)
                continue
            if req.padding:
                padding.append(req)
                continue
            # (drafts in flight are checked apart: speculation.py `check_in_flight`)
            if (computed == len(req.token_ids) and computed + 1 >= req.max_len) or (
                computed >= len(req.block_ids) * block_size
            ):
                if not self._decode_goes_on(req, step):
                    continue
            append(req)
        for req in padding:
            self._schedule_padding(req, step)
        self._steady.after_full_pass(step, not prefills and not padding)
        return prefills

    def _decode_goes_on(self, req: Request, step: StepBuilder) -> bool:
        """The two checks of a running decode (not in prefill, not padding): False when the
        sample in flight is its last (length: overlap gives it no extra step) or its table is
        full and no block can be had (nobody ranked below it to take one from: it waits)."""
        computed = req.num_computed_tokens
        # with drafts in flight (speculation) the worker may be up to num_draft_slots ahead:
        # a sample in flight may then end it, and its table must cover that much more
        ahead = computed + req.num_draft_slots
        if computed >= len(req.token_ids) and ahead + 1 >= req.max_len:
            return False
        if ahead >= len(req.block_ids) * self._block_size:  # its table is full: grow it
            if not self._batch.grow(req, ahead + 1, step):
                return False
            if self._caching and not req.num_draft_slots:  # decode-filled blocks to register
                step.grown.append(req)
        return True

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
        chunk_size, batch = self._config.chunk_size, self._batch
        for req in prefills:
            if step.budget_left == 0:
                return
            if (
                req.num_computed_tokens >= req.prefill_len
                or req.padding
                or req.rid not in batch
                or req.preempted_at_step == batch.round
            ):
                continue  # preempted (or, padding) since the list was made
            # dynamic/static: a member (re)starting looks up its cached prefix first
            fresh = self._caching and not req.block_ids and req.num_computed_tokens == 0
            if fresh and self._cache.attach_if_room(req, step):
                fresh = False  # a hit, counted
            start = req.num_computed_tokens
            # Room for at least one more token, preempting lower-ranked requests if need be;
            # then the chunk shrinks to what is free rather than preempt for all of it.
            if not batch.grow(req, start + 1, step):
                continue  # it waits
            fit = (len(req.block_ids) + self._pool.num_free) * self._block_size - start
            n = min(req.prefill_len - start, chunk_size, step.budget_left, fit)
            batch.grow(req, start + n, step)
            step.add_chunk(req, n)
            if fresh:  # a miss, counted once the request is scheduled
                self._cache.count(req, step)

    def _admit_waiting(self, step: StepBuilder, now: float) -> None:
        """Continuous mode: waiting requests join in policy order. Stops at the first that does
        not fit (no skipping ahead: that is what keeps fcfs fair and aging effective)."""
        admitted: list[Request] = []
        num_cached_admitted = 0  # prompt tokens the admitted found in the prefix cache
        config, cache, pool, bs = self._config, self._cache, self._pool, self._block_size
        batch, slo, is_aged = self._batch, self._slo, self._waiting.is_aged
        for req in self._waiting.ordered(now):
            if len(batch) >= config.max_num_seqs or step.budget_left == 0:
                break
            if slo is not None and not is_aged(req, now) and not slo.may_admit(req, len(batch)):
                break  # it would break a running request's TPOT target
            hits = cache.lookup(req) if self._caching else []
            num_cached = len(hits) * bs
            n = min(len(req.token_ids) - num_cached, config.chunk_size, step.budget_left)
            need = pool.blocks_needed(len(hits), num_cached + n)
            # The watermark protects running requests; with none running anyone may start.
            # Cached hits (ref count 0) are taken from the free count too.
            reviving = pool.num_reviving(hits) if hits else 0
            if not pool.can_allocate(need + reviving, keep_watermark=len(batch) > 0):
                break
            batch.start(req)
            if self._caching:
                cache.attach(req, hits, step)  # before allocating: never evicts its own hits
            batch.allocate_for(req, need)
            admitted.append(req)
            step.add_chunk(req, n)
            num_cached_admitted += num_cached
        for req in admitted:
            self._waiting.remove(req)
        if slo is not None:
            # the prompts' tokens served this step, computed or found cached: the slo policy
            # predicts a wait from whole prompts ahead, so its rate counts hits as served too
            num_prompt_tokens = step.num_counted_tokens - len(step.decodes) + num_cached_admitted
            slo.end_step(now, len(admitted), len(self._waiting), num_prompt_tokens)

    def _make_room_for_priority(self, step: StepBuilder, now: float) -> None:
        """Priority policy, all slots taken: a waiting request with a better (lower) priority
        than the worst running one (or an aged one, see policy.py) takes that one's slot, so a
        full batch of low-priority requests cannot hold a high-priority one back (priority
        inversion). One per step; the victim rejoins the queue behind it by its own priority
        (an un-aged victim never outranks an aged head), so they cannot swap back."""
        if len(self._batch) < self._config.max_num_seqs:
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

    def form_batch(self, now: float) -> None:
        """Dynamic/static: the next batch's members leave the queue together."""
        members: list[Request] = []
        for req in self._waiting.ordered(now):
            if len(members) == self._rules.batch_size:
                break
            members.append(req)
        for req in members:
            self._waiting.remove(req)
            self._batch.start(req)
