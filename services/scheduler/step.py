"""One step under construction: what runs, how many tokens each, and the plan it becomes.

Entries can be dropped again while the step is being built (a request scheduled earlier in the
step may be preempted later in it); the columnar `StepPlan` is assembled once, at the end.
Building the plan is where a request's view on the worker side advances: it becomes known to
the worker, its sent-block count and its computed-token count move forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.request import Request
from shared.protocol.worker_channel import NewSequence, StepPlan


@dataclass(slots=True)
class BuiltStep:
    plan: StepPlan
    is_prefill: list[bool]  # [B], for the step record
    num_prefill_tokens: int
    sampled: dict[str, Request]  # rid -> request for every sequence that samples
    # prefill chunks that fill at least one more block: registered in the prefix cache once
    # the step has completed (empty with prefix caching off). A block filled by a decode is
    # registered later, off this path: when its table next grows, or when it finishes or is
    # preempted.
    filled: list[Request]


class StepBuilder:
    """Decodes (one token each, the common case) are kept apart from prefill chunks so the
    plan's columns for hundreds of decodes are built with list comprehensions."""

    def __init__(self, token_budget: int, block_size: int = 0) -> None:
        """`block_size` 0: no prefix caching, so blocks filled by chunks are not tracked."""
        self.token_budget = token_budget
        self.block_size = block_size
        self.num_preemptions = 0
        # prefix-cache lookups of this step: tokens looked up, tokens found cached
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.decodes: list[Request] = []  # batch order; append directly
        # rid -> (request, num_tokens) for prefill chunks, in batch order after the decodes
        self._chunks: dict[str, tuple[Request, int]] = {}
        self._num_chunk_tokens = 0

    def __len__(self) -> int:
        return len(self.decodes) + len(self._chunks)

    @property
    def budget_left(self) -> int:
        return self.token_budget - len(self.decodes) - self._num_chunk_tokens

    @property
    def has_live(self) -> bool:
        """Something other than static padding runs (padding never finishes anything)."""
        return bool(self._chunks) or any(not r.padding for r in self.decodes)

    def add_chunk(self, req: Request, num_tokens: int) -> None:
        self._chunks[req.rid] = (req, num_tokens)
        self._num_chunk_tokens += num_tokens

    def drop(self, req: Request) -> None:
        """Unschedule `req` (it is being preempted); its tokens go back to the budget."""
        entry = self._chunks.pop(req.rid, None)
        if entry is not None:
            self._num_chunk_tokens -= entry[1]
        elif req in self.decodes:
            self.decodes.remove(req)

    def build(self, step_id: int, released_rids: list[str]) -> BuiltStep:
        """Assemble the columnar plan and advance each request's worker-side view.

        A decode costs O(1) (plus the blocks it appended); a chunk O(its tokens), and a request
        new to the worker also copies its token ids and block table into a `NewSequence`.
        """
        decodes = self.decodes
        rids: list[str] = []
        starts: list[int] = []
        token_ids: list[int] = []
        new_block_ids: list[list[int]] = []
        sampled: dict[str, Request] = {}
        no_blocks: list[int] = []  # shared by every decode that appended none (read-only)
        filled: list[Request] = []
        bs = self.block_size
        for r in decodes:  # one pass: the common case of a step, hundreds of times
            rid = r.rid
            start = r.num_computed_tokens
            blocks = r.block_ids
            rids.append(rid)
            starts.append(start)
            token_ids.append(r.token_ids[start])
            if len(blocks) == r.num_sent_blocks:
                new_block_ids.append(no_blocks)
            else:
                new_block_ids.append(blocks[r.num_sent_blocks :])
                r.num_sent_blocks = len(blocks)
            sampled[rid] = r
            r.num_computed_tokens = start + 1
        num_tokens = [1] * len(decodes)
        sample = [True] * len(decodes)
        is_prefill = [False] * len(decodes)
        new_seqs: list[NewSequence] = []
        for req, n in self._chunks.values():
            start = req.num_computed_tokens
            rids.append(req.rid)
            starts.append(start)
            num_tokens.append(n)
            is_prefill.append(True)
            token_ids.extend(req.token_ids[start : start + n])
            if not req.known_to_worker:
                seq = NewSequence(
                    req.rid,
                    list(req.token_ids),
                    req.num_prompt_tokens,
                    list(req.block_ids),
                    req.sampling,
                )
                new_seqs.append(seq)
                new_block_ids.append([])
                req.known_to_worker = True
            else:
                new_block_ids.append(req.block_ids[req.num_sent_blocks :])
            req.num_sent_blocks = len(req.block_ids)
            req.num_computed_tokens = start + n
            if bs and (start + n) // bs > req.num_registered_blocks:
                filled.append(req)
            done = start + n == len(req.token_ids)
            sample.append(done)
            if done:
                sampled[req.rid] = req
        plan = StepPlan(
            step_id,
            new_seqs,
            rids,
            starts,
            num_tokens,
            token_ids,
            new_block_ids,
            sample,
            released_rids,
        )
        return BuiltStep(plan, is_prefill, self._num_chunk_tokens, sampled, filled)
