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
    sampled: dict[str, Request]  # rid -> request for every sequence that samples


class StepBuilder:
    def __init__(self, token_budget: int) -> None:
        self.budget_left = token_budget
        self.num_preemptions = 0
        self.num_live = 0  # entries that are not static padding
        # rid -> (request, num_tokens, is_prefill), in batch order
        self._entries: dict[str, tuple[Request, int, bool]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, req: Request, num_tokens: int, is_prefill: bool) -> None:
        self._entries[req.rid] = (req, num_tokens, is_prefill)
        self.budget_left -= num_tokens
        if not req.padding:
            self.num_live += 1

    def drop(self, req: Request) -> None:
        """Unschedule `req` (it is being preempted) and refund its tokens."""
        entry = self._entries.pop(req.rid, None)
        if entry is not None:
            self.budget_left += entry[1]
            if not req.padding:
                self.num_live -= 1

    def build(self, step_id: int, released_rids: list[str]) -> BuiltStep:
        """Assemble the columnar plan and advance each request's worker-side view.

        Per entry O(tokens scheduled + blocks appended); a request new to the worker also
        copies its token ids and block table into its `NewSequence`.
        """
        new_seqs: list[NewSequence] = []
        rids: list[str] = []
        starts: list[int] = []
        num_tokens: list[int] = []
        token_ids: list[int] = []
        new_block_ids: list[list[int]] = []
        sample: list[bool] = []
        is_prefill: list[bool] = []
        sampled: dict[str, Request] = {}
        for req, n, prefill in self._entries.values():
            start = req.num_computed_tokens
            rids.append(req.rid)
            starts.append(start)
            num_tokens.append(n)
            is_prefill.append(prefill)
            tokens = req.token_ids
            if n == 1:
                token_ids.append(tokens[start])
            else:
                token_ids.extend(tokens[start : start + n])
            blocks = req.block_ids
            if not req.known_to_worker:
                seq = NewSequence(
                    req.rid, list(tokens), req.num_prompt_tokens, list(blocks), req.sampling
                )
                new_seqs.append(seq)
                new_block_ids.append([])
                req.known_to_worker = True
            elif len(blocks) > req.num_sent_blocks:
                new_block_ids.append(blocks[req.num_sent_blocks :])
            else:
                new_block_ids.append([])
            req.num_sent_blocks = len(blocks)
            req.num_computed_tokens = start + n
            done = start + n == len(tokens)
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
        return BuiltStep(plan, is_prefill, sampled)
