"""Step compositions (services/scheduler/composition.py): the shape of the forwards each one
builds when a long prompt arrives into running decodes, with the checking worker running every
plan (the same tokens whatever the composition). The property tests run every composition under
random workloads too (test_scheduler_properties.py, test_async_scheduling.py,
test_prefix_cache_properties.py)."""

from __future__ import annotations

from typing import Any

from test_scheduler_support import Run, drive, make, submit, token_for

from services.scheduler.stats import StepRecord

BUDGET = 16
DECODERS = ("d0", "d1", "d2")
LONG_PROMPT = 40


def _long_prompt_into_decodes(composition: str, **config: Any) -> tuple[Run, list[StepRecord]]:
    """Three requests decoding, then a 40-token prompt arriving at step 4: the run and the
    records of the steps from the arrival on."""
    sched, worker, clock = make(
        max_num_batched_tokens=BUDGET, chunk_size=BUDGET, step_composition=composition,
        async_scheduling=False, **config,
    )  # fmt: skip
    for rid in DECODERS:
        assert sched.add_request(submit(rid, 4, 24, ignore_eos=True)) is None

    def arrive(i: int) -> None:
        if i == 4:
            assert sched.add_request(submit("long", LONG_PROMPT, 4, ignore_eos=True)) is None

    run = drive(sched, worker, clock, before_step=arrive, max_steps=200)
    for rid in (*DECODERS, "long"):
        assert run.tokens(rid) == [token_for(rid, i, 1000) for i in range(len(run.tokens(rid)))]
    records = [r for r in run.records if isinstance(r, StepRecord)]
    first = next(i for i, r in enumerate(records) if "long" in r.rids)
    return run, records[first:]


def _shape(record: StepRecord) -> tuple[int, list[int]]:
    """(decodes, prompt chunk sizes) of one forward."""
    chunks = [n for n, p in zip(record.num_tokens, record.is_prefill, strict=True) if p]
    return len(record.rids) - len(chunks), chunks


def test_mixed_puts_the_chunks_beside_the_decodes_under_one_budget() -> None:
    _, records = _long_prompt_into_decodes("mixed")
    assert [_shape(r) for r in records[:4]] == [(3, [13]), (3, [13]), (3, [13]), (3, [1])]


def test_prefill_first_runs_the_prompt_alone_while_the_decodes_wait() -> None:
    _, records = _long_prompt_into_decodes("prefill-first")
    assert [_shape(r) for r in records[:4]] == [(0, [16]), (0, [16]), (0, [8]), (4, [])]


def test_decode_first_alternates_a_decode_forward_and_a_prompt_forward() -> None:
    _, records = _long_prompt_into_decodes("decode-first")
    shapes = [_shape(r) for r in records[:8]]
    # the prompt gets what the decodes left of the budget, in a forward of its own
    assert shapes == [(0, [13]), (3, []), (0, [13]), (3, []), (0, [13]), (3, []), (0, [1]), (4, [])]


def test_decode_first_admits_at_most_max_prefill_chunks_per_iteration() -> None:
    sched, worker, clock = make(max_num_batched_tokens=BUDGET, chunk_size=BUDGET,
                                step_composition="decode-first", max_prefill_chunks=2,
                                async_scheduling=False)  # fmt: skip
    for i in range(5):
        assert sched.add_request(submit(f"r{i}", 3, 3, ignore_eos=True)) is None
    run = drive(sched, worker, clock)
    shapes = [_shape(r) for r in run.records if isinstance(r, StepRecord)]
    assert shapes[:4] == [(0, [3, 3]), (2, []), (0, [3, 3]), (4, [])]
    assert all(len(chunks) <= 2 and (not chunks or not decodes) for decodes, chunks in shapes)


def test_prefill_first_decodes_when_no_prompt_can_be_admitted() -> None:
    """All slots taken: the waiting prompt cannot run, so the decodes go on (no stall)."""
    sched, worker, clock = make(
        max_num_seqs=2,
        max_num_batched_tokens=BUDGET,
        step_composition="prefill-first",
        async_scheduling=False,
    )
    for rid in ("a", "b", "c"):
        assert sched.add_request(submit(rid, 4, 6, ignore_eos=True)) is None
    run = drive(sched, worker, clock)
    shapes = [_shape(r) for r in run.records if isinstance(r, StepRecord)]
    assert shapes[:3] == [(0, [4, 4]), (2, []), (2, [])]
    assert run.final("c").finish_reason == "length"
