"""Writes persistent-batch step plans from an explicit description of one step.

For tools, benchmarks and tests that drive a worker without the scheduler (the scheduler builds
its plans itself, in services/scheduler/step.py, without a per-step pass over the batch). It
mirrors what the worker holds (which rid is in which slot) so that each `plan()` carries only
what changed, exactly as docs/design/step_contract.md describes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence, StepPlan


class PlanWriter:
    """One worker's batch as the writer has told it, and the next plan for it."""

    def __init__(self, first_step_id: int = 0) -> None:
        self.slots: dict[str, int] = {}  # held rid -> slot, in the order they joined
        self.next_step_id = first_step_id
        self._prev_step_id: Optional[int] = None  # None: the next plan is a reset
        self._taken: set[int] = set()  # slots held or handed to a NewSequence not yet sent

    def new_sequence(
        self,
        rid: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        block_ids: Sequence[int],
        sampling: SamplingParams,
        num_computed_tokens: int = 0,
    ) -> NewSequence:
        """A sequence for the next plan's `new_seqs`, in a free slot (pass it to `plan`)."""
        slot = 0
        while slot in self._taken:
            slot += 1
        self._taken.add(slot)
        return NewSequence(
            rid, list(token_ids), num_prompt_tokens, list(block_ids), sampling, slot,
            num_computed_tokens,
        )  # fmt: skip

    def plan(
        self,
        scheduled: Mapping[str, int],
        new_seqs: Sequence[NewSequence] = (),
        appended: Optional[Mapping[str, Sequence[int]]] = None,
        released: Sequence[str] = (),
        step_id: Optional[int] = None,
    ) -> StepPlan:
        """The plan in which exactly the rids of `scheduled` compute that many tokens each
        (every other held sequence waits), after `released` are dropped, `new_seqs` join and
        `appended` blocks are added to the tables of held rids."""
        released_slots = []
        for rid in released:
            slot = self.slots.pop(rid)
            released_slots.append(slot)
            self._taken.discard(slot)
        for seq in new_seqs:
            self._taken.add(seq.slot)
            self.slots[seq.rid] = seq.slot
        block_slots: list[int] = []
        block_ids: list[int] = []
        for rid, blocks in (appended or {}).items():
            block_slots.extend([self.slots[rid]] * len(blocks))
            block_ids.extend(blocks)
        count_slots: list[int] = []
        counts: list[int] = []
        for rid, slot in self.slots.items():
            n = scheduled.get(rid, 0)
            if n != 1:
                count_slots.append(slot)
                counts.append(n)
        unknown = set(scheduled) - self.slots.keys()
        if unknown:
            raise ValueError(f"scheduled rids the worker does not hold: {sorted(unknown)}")
        step = self.next_step_id if step_id is None else step_id
        plan = StepPlan(
            step, self._prev_step_id, len(self.slots), sum(scheduled.values()), list(new_seqs),
            released_slots, block_slots, block_ids, count_slots, counts,
        )  # fmt: skip
        self._prev_step_id = step
        self.next_step_id = step + 1
        return plan

    def samplers(self, plan: StepPlan, result_token_ids: Sequence[int],
                 sampling_rids: set[str]) -> dict[str, int]:  # fmt: skip
        """rid -> token of a result for `plan`: the result lists its tokens in the worker's
        batch order (the order sequences joined), which `slots` keeps; `sampling_rids` are
        the rids that sample in that plan (they reach the end of their histories)."""
        order = [rid for rid in self.slots if rid in sampling_rids]
        if len(order) != len(result_token_ids):
            raise ValueError(f"step {plan.step_id}: {len(result_token_ids)} tokens for "
                             f"{len(order)} sequences that sample")  # fmt: skip
        return dict(zip(order, result_token_ids, strict=True))

    def reset(self) -> None:
        """The worker lost its batch (a failed step): the next plan starts afresh."""
        self.slots.clear()
        self._taken.clear()
        self._prev_step_id = None
