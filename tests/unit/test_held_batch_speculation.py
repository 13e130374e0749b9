"""The worker's side of speculation's step contract (services/worker/held_batch.py): draft
limits, proposals, settling, table trims, and the structural checks of the new plan columns
(docs/design/speculation.md). Every refusal leaves the batch needing a reset plan."""

from __future__ import annotations

import pytest

from services.worker.held_batch import ExpandedStep, HeldBatch
from shared.protocol.codec import decode, encode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import (
    DraftOutcome,
    NewSequence,
    PlanDrafts,
    StepPlan,
    StepResult,
    check_plan,
)

SP = SamplingParams(temperature=0.0, max_tokens=16)


def _batch_with_decode() -> tuple[HeldBatch, ExpandedStep]:
    """Slot 0 holds "a": 4 prompt tokens computed, its output 0 (token 9) sampled; a table of
    2 blocks of 4. Returns the batch and the step that computed the prompt."""
    held = HeldBatch(num_blocks=8, block_size=4, max_model_len=12)
    new = NewSequence("a", [1, 2, 3, 4], 4, [5, 6], SP, slot=0)
    step = held.apply(StepPlan(1, None, 1, 4, [new], count_slots=[0], counts=[4]))
    held.record_samples(step.sampled(), [9])
    return held, step


def test_drafts_join_the_step_and_only_the_accepted_ones_stay() -> None:
    held, _ = _batch_with_decode()
    step = held.apply(StepPlan(2, 1, 1, 1, drafts=PlanDrafts([0], [3])))
    assert step.draft_limits == {0: 3} and step.num_tokens == [1]
    held.propose(step, 0, [7, 8, 10])
    seq = held.seqs[0]
    assert step.num_tokens == [4] and step.token_ids() == [9, 7, 8, 10]
    assert seq.num_computed == 8 and step.sample == [True]
    held.settle(step, 0, 1)  # 7 accepted: 8 and 10 leave history and computed count
    held.record_samples(step.sampled(), [11])  # the target's token after the accepted draft
    assert seq.token_ids == [1, 2, 3, 4, 9, 7, 11] and seq.num_computed == 6
    held.check_invariants()
    nxt = held.apply(StepPlan(3, 2, 1, 1))  # a plain decode of 11, from position 6
    assert nxt.start_positions == [6] and nxt.token_ids() == [11]


def test_a_proposal_past_its_limit_and_a_settle_past_the_drafts_are_refused() -> None:
    held, _ = _batch_with_decode()
    step = held.apply(StepPlan(2, 1, 1, 1, drafts=PlanDrafts([0], [2])))
    with pytest.raises(ValueError, match="past its limit"):
        held.propose(step, 0, [7, 8, 10])
    held.propose(step, 0, [7])
    with pytest.raises(ValueError, match="accepted of 1"):
        held.settle(step, 0, 2)


def test_drafts_must_fit_the_table_and_go_to_a_decode() -> None:
    held, _ = _batch_with_decode()
    with pytest.raises(ValueError, match="past its table"):  # positions 4..8, table holds 8
        held.apply(StepPlan(2, 1, 1, 1, drafts=PlanDrafts([0], [4])))
    assert held.needs_reset
    held, _ = _batch_with_decode()
    with pytest.raises(ValueError, match="no decode"):  # it waits this step
        held.apply(StepPlan(2, 1, 1, 0, count_slots=[0], counts=[0],
                            drafts=PlanDrafts([0], [1])))  # fmt: skip


def test_trims_cut_tables_before_blocks_are_appended_never_below_the_kv() -> None:
    held, _ = _batch_with_decode()
    step = held.apply(StepPlan(2, 1, 1, 1, block_slots=[0], block_ids=[3],
                               drafts=PlanDrafts(trim_slots=[0], trim_lens=[1])))  # fmt: skip
    assert step.seqs[0].block_ids == [5, 3]  # cut to [5], then 3 appended
    with pytest.raises(ValueError, match="below its KV"):  # 5 tokens computed: 2 blocks
        held.apply(StepPlan(3, 2, 1, 1, drafts=PlanDrafts(trim_slots=[0], trim_lens=[1])))
    held, _ = _batch_with_decode()
    with pytest.raises(ValueError, match="past its table"):
        held.apply(StepPlan(2, 1, 1, 1, drafts=PlanDrafts(trim_slots=[0], trim_lens=[3])))


@pytest.mark.parametrize(
    "drafts, why",
    [
        (PlanDrafts([0], []), "differ in length"),
        (PlanDrafts(trim_slots=[0, 0], trim_lens=[1, 1]), "trims a slot twice"),
        (PlanDrafts([0], [0]), "one below 1"),
        (PlanDrafts([-1], [1]), "negative slot"),
    ],
)
def test_check_plan_refuses_malformed_speculation_columns(drafts: PlanDrafts, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_plan(StepPlan(2, 1, 1, 1, drafts=drafts))


def test_speculation_columns_round_trip_and_are_absent_from_plain_frames() -> None:
    plan = StepPlan(5, 4, 2, 2, drafts=PlanDrafts([0], [3], [1], [2]))
    assert decode(encode(plan)) == plan
    result = StepResult(5, [1, 2], drafts=DraftOutcome([0], [3], [1], [7]))
    assert decode(encode(result)) == result
    assert b"drafts" not in encode(StepPlan(5, 4, 2, 2))
    assert b"drafts" not in encode(StepResult(5, [1, 2]))
