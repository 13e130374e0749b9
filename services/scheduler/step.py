"""One step under construction: what runs, how many tokens each, and the plan it becomes.

Entries can be dropped again while the step is being built (a request scheduled earlier in the
step may be preempted later in it); the columnar `StepPlan` is assembled once, at the end.
Building the plan is where a request's view on the worker side advances: it takes a slot in the
worker's batch, its sent-block count and its computed-token count move forward. The plan names
only what changed (docs/design/step_contract.md): a decode of a held request with no new block
costs nothing on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from services.scheduler.request import Request
from services.scheduler.worker_view import WorkerView
from shared.protocol.worker_channel import NewSequence, PlanDrafts, StepPlan
from shared.step_cost import StepShape


@dataclass(slots=True)
class BuiltStep:
    plan: StepPlan
    # [B] every request that computes, in batch order (the step record; read-only: a steady
    # step without chunks shares the steady run's own list)
    rids: list[str]
    num_tokens: list[int]  # [B]
    is_prefill: list[bool]  # [B], for the step record
    num_prefill_tokens: int
    # [S] every sequence that samples, in the worker's batch order (a result's tokens are
    # in this order), and their rids (shared with the worker view while it is unchanged)
    sampled: list[Request]
    sampled_rids: list[str]
    steady: bool  # every held request decodes (and samples): `sampled` is the whole batch
    # prefill chunks that fill at least one more block, each as (request, its preemption
    # count, the full blocks of its table once this step has completed): a snapshot taken
    # here, so the blocks a later plan in flight fills are not mistaken for this step's. Queued
    # for registration in the prefix cache when the step's result arrives, registered off the
    # result -> plan path (empty with prefix caching off). A block filled by a decode is
    # registered later, off this path too: when its table next grows, or when it finishes or
    # is preempted.
    filled: list[tuple[Request, int, int]]
    # speculation: (request, its draft limit) of each decode that may draft in this step
    drafts: list[tuple[Request, int]]


class StepBuilder:
    """Decodes (one token each, the common case) are kept apart from prefill chunks so the
    plan's columns for hundreds of decodes are built with list comprehensions."""

    def __init__(
        self, token_budget: int, block_size: int = 0, max_chunks: Optional[int] = None
    ) -> None:
        """`block_size` 0: no prefix caching, so blocks filled by chunks are not tracked.
        `max_chunks`: at most this many prompt chunks (the step composition's limit)."""
        self.token_budget = token_budget
        self.block_size = block_size
        self.max_chunks = max_chunks
        self.num_preemptions = 0
        # prefix-cache lookups of this step: tokens looked up, tokens found cached
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.decodes: list[Request] = []  # batch order; append directly
        # decodes whose table grew by a block in this step (prefix caching queues the blocks
        # before the new one for registration); append directly
        self.grown: list[Request] = []
        # `reuse_decodes`: the rids of the reused list, and the decodes that were checked
        self._reused: Optional[tuple[list[str], list[Request]]] = None
        # rid -> (request, num_tokens) for prefill chunks, in batch order after the decodes
        self._chunks: dict[str, tuple[Request, int]] = {}
        self._num_chunk_tokens = 0
        # speculation: (decode, draft limit), the limits counted in the budget
        self.drafts: list[tuple[Request, int]] = []
        self._num_draft_tokens = 0
        # `final_shape`'s (number of decodes it counted, shape): dropped when a chunk is added or
        # a request dropped; appended decodes (the filler's hot loop appends to the list itself)
        # change the count, so the shape is walked again
        self._shape: Optional[tuple[int, StepShape]] = None

    def __len__(self) -> int:
        return len(self.decodes) + len(self._chunks)

    @property
    def budget_left(self) -> int:
        """Tokens another chunk may take: 0 once the budget or the chunk limit is
        reached."""
        if self.max_chunks is not None and len(self._chunks) >= self.max_chunks:
            return 0
        return (
            self.token_budget - len(self.decodes) - self._num_chunk_tokens
            - self._num_draft_tokens
        )  # fmt: skip

    @property
    def draft_budget_left(self) -> int:
        """Tokens drafts may still take: the budget less every token scheduled (the chunk
        limit does not bound drafts)."""
        return self.token_budget - self.num_counted_tokens - self._num_draft_tokens

    @property
    def num_counted_tokens(self) -> int:
        """The step's tokens without drafts: one per decode and its chunks' tokens."""
        return len(self.decodes) + self._num_chunk_tokens

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def has_live(self) -> bool:
        """Something other than static padding runs (padding never finishes anything)."""
        return bool(self._chunks) or any(not r.padding for r in self.decodes)

    def reuse_decodes(
        self, decodes: list[Request], rids: list[str], checked: list[Request]
    ) -> None:
        """This step's decodes are the last step's list again (a steady run,
        services/scheduler/steady.py): `rids` are theirs (read-only), and only the `checked`
        ones may have new blocks; every other one is held by the worker with its whole table."""
        self.decodes = list(decodes)
        self._reused = (rids, checked)
        self._shape = None

    def add_chunk(self, req: Request, num_tokens: int) -> None:
        self._shape = None
        self._chunks[req.rid] = (req, num_tokens)
        self._num_chunk_tokens += num_tokens

    def add_drafts(self, req: Request, limit: int) -> None:
        """`req`, a decode of this step, may also compute up to `limit` drafts (speculation);
        its table covers them already."""
        self.drafts.append((req, limit))
        self._num_draft_tokens += limit

    def drop(self, req: Request) -> None:
        """Unschedule `req` (it is being preempted); its tokens go back to the budget."""
        self._shape = None
        entry = self._chunks.pop(req.rid, None)
        if entry is not None:
            self._num_chunk_tokens -= entry[1]
        elif req in self.decodes:
            self.decodes.remove(req)
            if self.drafts:
                kept = [(r, k) for r, k in self.drafts if r is not req]
                self._num_draft_tokens -= sum(k for r, k in self.drafts if r is req)
                self.drafts = kept

    def shape(self) -> StepShape:
        """What this step computes, for the step-time predictor (shared/step_cost.py); called
        before `build` advances the computed counts. O(rows)."""
        num_decodes = len(self.decodes)
        context = sum(r.num_computed_tokens for r in self.decodes)  # each decode's start
        pairs, kv, num_sampled = context + num_decodes, context + 2 * num_decodes, num_decodes
        for req, n in self._chunks.values():
            s = req.num_computed_tokens
            pairs += n * s + n * (n + 1) // 2
            kv += s + 2 * n
            num_sampled += s + n >= len(req.token_ids)
        rows, tokens = num_decodes + len(self._chunks), num_decodes + self._num_chunk_tokens
        has_chunk = any(n > 1 for _, n in self._chunks.values())
        return StepShape(rows, tokens, num_sampled, pairs, kv, has_chunk)

    def final_shape(self) -> StepShape:
        """`shape()`, walked once per step: called when the decodes and chunks are in (drafts
        do not change it): speculation's draft limits, then the step costs at build. O(rows)
        the first time; walked again if decodes were appended or a request dropped since."""
        cached = self._shape
        if cached is None or cached[0] != len(self.decodes):
            cached = self._shape = (len(self.decodes), self.shape())
        return cached[1]

    def build(self, step_id: int, worker: WorkerView, held: Iterable[Request]) -> BuiltStep:
        """Assemble the plan (only what changed in the worker's batch) and advance each
        request's worker-side view. `held`: the running requests (those with a slot are in
        the worker's batch); walked only when a held request does not compute this step.

        A decode costs O(1) and emits nothing unless its table grew; a chunk O(1) plus, for a
        request new to the worker, a copy of its token ids and block table.
        """
        block_slots: list[int] = []
        block_ids: list[int] = []
        count_slots: list[int] = []
        counts: list[int] = []
        chunk_samplers: set[str] = set()
        new_seqs: list[NewSequence] = []
        released = worker.take_released()
        reused = self._reused
        if reused is not None and len(reused[0]) == len(self.decodes) and not self.drafts:
            # for the step record: the run's list itself (read-only) unless chunks follow
            rids = list(reused[0]) if self._chunks else reused[0]
            _send_blocks(reused[1], block_slots, block_ids)  # only checked ones can send blocks
            for r in self.decodes:
                r.num_computed_tokens += 1
        else:
            rids = self._decode_pass(worker, new_seqs, block_slots, block_ids)
        num_tokens = [1] * len(self.decodes)
        is_prefill = [False] * len(self.decodes)
        filled: list[tuple[Request, int, int]] = []
        bs = self.block_size
        for req, n in self._chunks.values():
            start = req.num_computed_tokens
            rids.append(req.rid)
            num_tokens.append(n)
            is_prefill.append(True)
            if req.slot is None:
                new_seqs.append(_new_sequence(req, worker))
            else:  # a few chunks a step: the shared helper (decodes inline it, _decode_pass)
                _send_blocks([req], block_slots, block_ids)
            if n != 1:
                count_slots.append(req.slot)
                counts.append(n)
            req.num_computed_tokens = start + n
            if bs and (start + n) // bs > req.num_registered_blocks:  # its table covers them
                filled.append((req, req.num_preemptions, (start + n) // bs))
            if start + n == len(req.token_ids):
                chunk_samplers.add(req.rid)
        if worker.num_held > len(rids):
            _waiting_counts(held, rids, count_slots, counts)
        drafts = self._plan_drafts(worker) if self.drafts or worker.trims else None
        plan = StepPlan(
            step_id, worker.prev_step_id, worker.num_held,
            len(self.decodes) + self._num_chunk_tokens, new_seqs, released, block_slots,
            block_ids, count_slots, counts, drafts,
        )  # fmt: skip
        worker.prev_step_id = step_id
        steady = len(self.decodes) == worker.num_held and not self._chunks
        sampled, sampled_rids = self._samplers(worker, chunk_samplers, steady)
        return BuiltStep(plan, rids, num_tokens, is_prefill, self._num_chunk_tokens, sampled,
                         sampled_rids, steady and not self.drafts, filled,
                         self.drafts)  # fmt: skip

    def _plan_drafts(self, worker: WorkerView) -> PlanDrafts:
        """The plan's speculation columns: draft limits (each decode has its slot by now; its
        draft slots in flight grow by its limit) and the trims of tables given blocks back."""
        slots: list[int] = []
        limits: list[int] = []
        for req, k in self.drafts:
            assert req.slot is not None  # a decode of this step: held by the worker now
            slots.append(req.slot)
            limits.append(k)
            req.num_draft_slots += k
        trim_slots, trim_lens = worker.take_trims()
        return PlanDrafts(slots, limits, trim_slots, trim_lens)

    def _decode_pass(
        self,
        worker: WorkerView,
        new_seqs: list[NewSequence],
        block_slots: list[int],
        block_ids: list[int],
    ) -> list[str]:
        """Every decode: resent if the worker lost it, its new blocks, one more computed
        token. Returns their rids (the step record's list starts with them)."""
        rids: list[str] = []
        for r in self.decodes:  # one pass: the common case of a step, hundreds of times
            rids.append(r.rid)
            if r.slot is None:  # resent after the worker's batch was reset
                new_seqs.append(_new_sequence(r, worker))
            elif len(r.block_ids) != r.num_sent_blocks:
                added = r.block_ids[r.num_sent_blocks :]
                block_slots.extend([r.slot] * len(added))
                block_ids.extend(added)
                r.num_sent_blocks = len(r.block_ids)
            r.num_computed_tokens += 1
        return rids

    def _samplers(
        self, worker: WorkerView, chunk_samplers: set[str], steady: bool
    ) -> tuple[list[Request], list[str]]:
        """The requests that sample (every decode, the chunks that end their history) and
        their rids, in the worker's batch order. A steady step, where every held request
        decodes, shares the view's lists; a step in which every held request computes copies
        them less its chunks that do not sample: neither walks the batch in Python."""
        if steady:
            return worker.held_lists()
        if len(self.decodes) + len(self._chunks) == worker.num_held:  # nobody waits
            return worker.held_lists_without(
                [rid for rid in self._chunks if rid not in chunk_samplers]
            )
        samplers = {r.rid for r in self.decodes} | chunk_samplers
        sampled = [r for r in worker.order.values() if r.rid in samplers]
        return sampled, [r.rid for r in sampled]


def _waiting_counts(
    held: Iterable[Request], rids: list[str], count_slots: list[int], counts: list[int]
) -> None:
    """Held requests that wait this step (not in `rids`) compute 0 tokens."""
    scheduled = set(rids)
    for req in held:
        if req.slot is not None and req.rid not in scheduled:
            count_slots.append(req.slot)
            counts.append(0)


def _send_blocks(reqs: list[Request], block_slots: list[int], block_ids: list[int]) -> None:
    """The blocks of `reqs` (each held by the worker) that the worker does not know yet."""
    for r in reqs:
        if len(r.block_ids) != r.num_sent_blocks:
            added = r.block_ids[r.num_sent_blocks :]
            block_slots.extend([r.slot] * len(added))
            block_ids.extend(added)
            r.num_sent_blocks = len(r.block_ids)


def _new_sequence(req: Request, worker: WorkerView) -> NewSequence:
    """`req` joins the worker's batch in a free slot, with its history and whole table."""
    req.slot = worker.take_slot(req)
    req.num_sent_blocks = len(req.block_ids)
    return NewSequence(
        req.rid, list(req.token_ids), req.num_prompt_tokens, list(req.block_ids), req.sampling,
        req.slot, req.num_computed_tokens, req.traceparent,
    )  # fmt: skip
