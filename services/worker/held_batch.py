"""The worker's persistent batch: the sequences it holds between steps, and how a plan moves it.

Every worker (the real model worker and the simulated one) applies plans through this one class,
so the step contract (docs/design/step_contract.md) is checked the same way everywhere. It is
the one owner of the held sequences: their histories, block tables and computed counts change
only through its methods (`apply`, `record_samples`, `reserve_samples`, `land_samples`); the
runner reads them.

A plan names only what changed (shared/protocol/worker_channel.py `StepPlan`); the batch turns
it into the explicit step: which sequences compute how many tokens from which
position, and which of them sample. A plan that does not fit what is held (a skipped plan, a
sequence computing past its history or block table, other counts) raises ValueError and leaves
the batch *poisoned*: only a reset plan (`prev_step_id` None) is accepted after that, so a worker
never computes garbage for a batch it does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import (
    NewSequence,
    PlanDrafts,
    StepPlan,
    check_plan,
    default_seed,
)

# A sampled token still only on the device (pipelined steps, services/worker/pipeline.py): it
# keeps a history's length right until the token lands. Far outside any vocabulary (not -1,
# which tensor indexing would wrap to the last row), so a slip fails the embedding lookup
# loudly instead of computing a wrong token.
PENDING_TOKEN = 1 << 62


def request_seed(rid: str, seed: Optional[int]) -> int:
    """A sequence's sampling seed: the client's, else a stable function of the rid
    (worker_channel.default_seed, which the frontend pins on the requests it submits)."""
    return seed if seed is not None else default_seed(rid)


@dataclass(slots=True, eq=False)
class HeldSeq:
    """One sequence of the batch (its slot is the key it is held under)."""

    rid: str
    slot: int
    token_ids: list[int]  # prompt, then outputs, with this worker's own samples appended
    num_prompt_tokens: int
    num_computed: int  # tokens whose KV its blocks hold (after the steps applied so far)
    block_ids: list[int]  # its block table
    sampling: SamplingParams
    seed: int  # request_seed: the model worker's draws for output n are u(seed, n)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class ExpandedStep:
    """One applied plan, explicit: parallel lists over the sequences that compute, in batch
    order (sequences with a count of 0 are left out)."""

    step_id: int
    seqs: list[HeldSeq]  # [B]
    start_positions: list[int]  # [B] computed count before this step
    num_tokens: list[int]  # [B] >= 1
    sample: list[bool]  # [B] the step reaches the end of its history
    new_seqs: list[HeldSeq]  # added by this plan
    released: list[HeldSeq]  # dropped by this plan
    # speculation: b -> the most drafts seqs[b] may compute (a decode that samples); None: none
    draft_limits: Optional[dict[int, int]] = None
    # b -> the drafts proposed for seqs[b] (`HeldBatch.propose`), already in its history and
    # counted in num_tokens[b]
    drafts: Optional[dict[int, list[int]]] = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def rids(self) -> list[str]:
        return [s.rid for s in self.seqs]

    @property
    def released_rids(self) -> list[str]:
        return [s.rid for s in self.released]

    def token_ids(self) -> list[int]:
        """[total_tokens] the tokens computed, concatenated in batch order."""
        out: list[int] = []
        for seq, start, n in zip(self.seqs, self.start_positions, self.num_tokens, strict=True):
            out.extend(seq.token_ids[start : start + n])
        return out

    def sampled(self) -> list[HeldSeq]:
        return [s for s, flag in zip(self.seqs, self.sample, strict=True) if flag]


class HeldBatch:
    """The sequences one worker rank holds, by slot (batch order: the order they joined)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.seqs: dict[int, HeldSeq] = {}
        self.last_step_id: Optional[int] = None  # the last plan applied; None: needs a reset

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, plan: StepPlan) -> ExpandedStep:
        """Called once per plan, before computing it: move the batch and say what computes.

        Raises ValueError when the plan does not fit what is held; the batch then accepts only
        a reset plan."""
        last, self.last_step_id = self.last_step_id, None  # None until fully applied
        check_plan(plan)
        if plan.prev_step_id is None:
            self.seqs.clear()
        elif last is None or plan.prev_step_id != last:
            held = "no batch (a reset is needed)" if last is None else f"step {last}"
            raise ValueError(
                f"plan {plan.step_id} extends step {plan.prev_step_id}, this worker holds {held}"
            )
        released = [self._release(slot, plan.step_id) for slot in plan.released_slots]
        added = [self._add(seq) for seq in plan.new_seqs]
        if len(self.seqs) != plan.num_seqs:
            raise ValueError(
                f"plan {plan.step_id} is for {plan.num_seqs} sequences, this worker holds "
                f"{len(self.seqs)}"
            )
        drafts = plan.drafts
        if drafts is not None and drafts.trim_slots:
            self._trim_tables(plan.step_id, drafts)
        self._append_blocks(plan)
        step = self._expand(plan, added, released)
        if drafts is not None and drafts.slots:
            step.draft_limits = self._draft_limits(plan.step_id, drafts, step)
        self.last_step_id = plan.step_id
        return step

    @property
    def needs_reset(self) -> bool:
        """Whether only a reset plan is accepted (no plan applied yet, or one failed)."""
        return self.last_step_id is None

    def fail(self) -> None:
        """Called when a step fails after `apply`: the batch needs a reset plan."""
        self.last_step_id = None

    def record_samples(self, seqs: Sequence[HeldSeq], token_ids: Sequence[int]) -> None:
        """Append each sampled token to its history (called after sampling, `seqs` from the
        step just applied): the next step's decode computes it, penalties and the seed counter
        see it."""
        for seq, tok in zip(seqs, token_ids, strict=True):
            seq.token_ids.append(tok)

    def propose(self, step: ExpandedStep, b: int, draft_ids: Sequence[int]) -> None:
        """Speculation: the drafts a proposer made for `step.seqs[b]` (at most its limit) join
        its history and are computed in this step after its decode token (called after `apply`,
        before the inputs are built). `settle` keeps the accepted ones."""
        limits = step.draft_limits
        if not draft_ids:
            return
        if limits is None or len(draft_ids) > limits.get(b, 0):
            raise ValueError(f"{step.seqs[b].rid!r}: {len(draft_ids)} drafts past its limit")
        seq = step.seqs[b]
        seq.token_ids.extend(draft_ids)
        seq.num_computed += len(draft_ids)
        step.num_tokens[b] += len(draft_ids)
        if step.drafts is None:
            step.drafts = {}
        step.drafts[b] = list(draft_ids)

    def settle(self, step: ExpandedStep, b: int, num_accepted: int) -> None:
        """After verification: the first `num_accepted` drafts of `step.seqs[b]` stay in its
        history (they are outputs now, their KV is right); the rejected ones leave it and its
        computed count (their KV is written again when the target's tokens are computed there).
        Call before `record_samples` appends the target's token after them."""
        drafts = (step.drafts or {}).get(b, [])
        if not 0 <= num_accepted <= len(drafts):
            raise ValueError(f"{num_accepted} accepted of {len(drafts)} drafts")
        rejected = len(drafts) - num_accepted
        if rejected:
            seq = step.seqs[b]
            del seq.token_ids[len(seq.token_ids) - rejected :]
            seq.num_computed -= rejected

    def reserve_samples(self, seqs: Sequence[HeldSeq]) -> list[int]:
        """Append PENDING_TOKEN for each sample still on the device (a pipelined step,
        launched); returns where each one sits in its history, for `land_samples`."""
        positions = []
        for seq in seqs:
            seq.token_ids.append(PENDING_TOKEN)
            positions.append(len(seq.token_ids) - 1)
        return positions

    def land_samples(
        self, seqs: Sequence[HeldSeq], positions: Sequence[int], token_ids: Sequence[int]
    ) -> None:
        """Write landed tokens over the placeholders `reserve_samples` left (called once the
        step's tokens are on the host, before anything reads the histories there)."""
        for seq, pos, tok in zip(seqs, positions, token_ids, strict=True):
            seq.token_ids[pos] = tok

    def check_invariants(self) -> None:
        """Raise AssertionError when a held sequence is inconsistent; reads only (tests call it
        between steps; O(tokens held)). Each sequence sits under its slot; its computed count
        fits its history, its block table and max_model_len; its block ids are in the pool;
        its prompt lies before its outputs; a PENDING_TOKEN only stands for an output."""
        for slot, seq in self.seqs.items():
            assert seq.slot == slot, (slot, seq.rid, seq.slot)
            assert 0 < seq.num_prompt_tokens <= len(seq.token_ids), seq.rid
            assert 0 <= seq.num_computed <= len(seq.token_ids), seq.rid
            assert seq.num_computed <= len(seq.block_ids) * self.block_size, seq.rid
            assert seq.num_computed <= self.max_model_len, seq.rid
            assert all(0 <= b < self.num_blocks for b in seq.block_ids), seq.rid
            assert PENDING_TOKEN not in seq.token_ids[: seq.num_prompt_tokens], seq.rid

    def _release(self, slot: int, step_id: int) -> HeldSeq:
        seq = self.seqs.pop(slot, None)
        if seq is None:
            raise ValueError(f"plan {step_id} releases slot {slot}, which holds nothing")
        return seq

    def _add(self, new: NewSequence) -> HeldSeq:
        if new.slot in self.seqs:
            raise ValueError(f"new sequence {new.rid!r} takes slot {new.slot}, which is held")
        self._check_blocks(new.rid, new.block_ids)
        seq = HeldSeq(
            rid=new.rid,
            slot=new.slot,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed=new.num_computed_tokens,
            block_ids=list(new.block_ids),
            sampling=new.sampling,
            seed=request_seed(new.rid, new.sampling.seed),
        )
        self.seqs[new.slot] = seq
        return seq

    def _check_blocks(self, rid: str, block_ids: list[int]) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise ValueError(f"rid {rid!r}: block id outside [0, {self.num_blocks})")

    def _trim_tables(self, step_id: int, drafts: PlanDrafts) -> None:
        """Cut tables the scheduler gave blocks back from (rejected drafts): never below what
        the sequence has computed."""
        for slot, num_blocks in zip(drafts.trim_slots, drafts.trim_lens, strict=True):
            seq = self.seqs.get(slot)
            if seq is None or num_blocks > len(seq.block_ids):
                raise ValueError(f"plan {step_id} trims slot {slot} past its table")
            if num_blocks * self.block_size < seq.num_computed:
                raise ValueError(f"plan {step_id} trims {seq.rid!r} below its KV")
            del seq.block_ids[num_blocks:]

    def _draft_limits(self, step_id: int, drafts: PlanDrafts, step: ExpandedStep) -> dict[int, int]:
        """b -> draft limit, each checked: the sequence decodes (one token, and samples), and
        its drafts fit its block table and max_model_len."""
        where = {seq.slot: b for b, seq in enumerate(step.seqs)}
        limits: dict[int, int] = {}
        for slot, limit in zip(drafts.slots, drafts.limits, strict=True):
            b = where.get(slot)
            if b is None or step.num_tokens[b] != 1 or not step.sample[b]:
                raise ValueError(f"plan {step_id} gives drafts to slot {slot}, no decode")
            seq = step.seqs[b]
            end = seq.num_computed + limit
            if end > len(seq.block_ids) * self.block_size or end > self.max_model_len:
                raise ValueError(f"plan {step_id}: {seq.rid!r}'s drafts would reach "
                                 f"{end}, past its table or max_model_len")  # fmt: skip
            limits[b] = limit
        return limits

    def _append_blocks(self, plan: StepPlan) -> None:
        seqs = self.seqs
        for slot, block in zip(plan.block_slots, plan.block_ids, strict=True):
            seq = seqs.get(slot)
            if seq is None:
                raise ValueError(f"plan {plan.step_id} appends a block to empty slot {slot}")
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"rid {seq.rid!r}: block id outside [0, {self.num_blocks})")
            seq.block_ids.append(block)

    def _expand(
        self, plan: StepPlan, added: list[HeldSeq], released: list[HeldSeq]
    ) -> ExpandedStep:
        """The explicit step; advances every computing sequence's computed count. The hot loop
        of a steady step (one pass over the batch, no override lookups when there are none)."""
        counts = dict(zip(plan.count_slots, plan.counts, strict=True)) if plan.counts else None
        if counts is not None and not counts.keys() <= self.seqs.keys():
            raise ValueError(f"plan {plan.step_id} gives a token count to an empty slot")
        bs, max_len = self.block_size, self.max_model_len
        seqs: list[HeldSeq] = []
        starts: list[int] = []
        nums: list[int] = []
        sample: list[bool] = []
        total = 0
        for slot, seq in self.seqs.items():
            n = 1 if counts is None else counts.get(slot, 1)
            if n == 0:
                continue
            start = seq.num_computed
            end = start + n
            history = len(seq.token_ids)
            if end > history or end > len(seq.block_ids) * bs or end > max_len:
                raise ValueError(_overrun(plan.step_id, seq, end, bs, max_len))
            seq.num_computed = end
            seqs.append(seq)
            starts.append(start)
            nums.append(n)
            sample.append(end == history)
            total += n
        if total != plan.num_scheduled_tokens:
            raise ValueError(
                f"plan {plan.step_id} schedules {plan.num_scheduled_tokens} tokens, this "
                f"worker's batch computes {total}"
            )
        return ExpandedStep(plan.step_id, seqs, starts, nums, sample, added, released)


def _overrun(step_id: int, seq: HeldSeq, end: int, block_size: int, max_len: int) -> str:
    if end > len(seq.token_ids):
        what = f"{len(seq.token_ids)} tokens held"
    elif end > len(seq.block_ids) * block_size:
        what = f"a block table of {len(seq.block_ids)} blocks"
    else:
        what = f"max_model_len {max_len}"
    return f"plan {step_id}: {seq.rid!r} would compute up to {end} tokens past {what}"
