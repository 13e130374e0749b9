"""Scheduler core: config, admission, finishing, abort, the plan's deltas, the block pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_scheduler_support import Run, drive, last_record, make, submit, token_for

from services.scheduler import SchedulerConfig
from services.scheduler.block_pool import BlockPool
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import StepResult, TokenLogprobs

# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_seqs": 0},
        {"max_num_seqs": 64, "max_num_batched_tokens": 32},  # decodes would not fit
        {"chunk_size": 0},
        {"batch_size": 0},
        {"max_num_seqs": 8, "batch_size": 9},
        {"batch_timeout": -1.0},
        {"max_wait": -0.5},
        {"policy": "lifo"},
        {"batching": "greedy"},
        {"watermark": 1.0},
        {"max_waiting": True},
        {"step_composition": "alternate"},
        {"max_prefill_chunks": 0},
    ],
)
def test_config_rejects_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid scheduler config"):
        SchedulerConfig(**kw)


def test_config_defaults_are_valid_and_batch_size_follows_max_num_seqs() -> None:
    assert SchedulerConfig().effective_batch_size == SchedulerConfig().max_num_seqs
    assert SchedulerConfig(max_num_seqs=8).effective_batch_size == 8
    assert SchedulerConfig(max_num_seqs=8, batch_size=3).effective_batch_size == 3


# ---- admission -------------------------------------------------------------------------------


def test_prompt_too_long_for_max_model_len_is_rejected() -> None:
    sched, _, _ = make(max_model_len=16)
    assert sched.add_request(submit("ok", 15, 4)) is None
    rejected = sched.add_request(submit("long", 16, 4))
    assert rejected is not None and rejected.code == ErrorCode.PROMPT_TOO_LONG
    assert "max_model_len 16" in rejected.message


def test_prompt_larger_than_the_whole_kv_pool_is_rejected() -> None:
    sched, _, _ = make(num_blocks=4, block_size=4, max_model_len=1000)
    assert sched.add_request(submit("fits", 16, 1)) is None
    rejected = sched.add_request(submit("never", 17, 1))
    assert rejected is not None and rejected.code == ErrorCode.PROMPT_TOO_LONG
    assert "KV cache holds 16" in rejected.message


def test_waiting_queue_bound_gives_overloaded() -> None:
    sched, _, _ = make(max_waiting=2)
    assert sched.add_request(submit("a", 4, 1)) is None
    assert sched.add_request(submit("b", 4, 1)) is None
    rejected = sched.add_request(submit("c", 4, 1))
    assert rejected is not None and rejected.code == ErrorCode.OVERLOADED
    assert sched.stats()["num_rejected"] == 1


def test_duplicate_live_rid_is_rejected_and_a_finished_rid_may_return() -> None:
    sched, worker, clock = make()
    assert sched.add_request(submit("a", 4, 2)) is None
    rejected = sched.add_request(submit("a", 4, 2))
    assert rejected is not None and rejected.code == ErrorCode.DUPLICATE_ID
    drive(sched, worker, clock)
    assert sched.add_request(submit("a", 4, 2)) is None


# ---- finishing -------------------------------------------------------------------------------


def _first_output_tokens(rid: str, n: int) -> list[int]:
    return [token_for(rid, i, 1000) for i in range(n)]


def test_eos_stops_and_is_included_unless_ignore_eos() -> None:
    eos = _first_output_tokens("e", 3)[2]  # the 3rd token "e" will produce
    sched, worker, clock = make(eos=(eos,))
    sched.add_request(submit("e", 5, 10))
    sched.add_request(submit("i", 5, 10, ignore_eos=True))
    run = drive(sched, worker, clock)
    assert run.tokens("e") == _first_output_tokens("e", 3)
    assert run.final("e").finish_reason == "stop"
    assert run.final("i").finish_reason == "length" and len(run.tokens("i")) == 10


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    stop = _first_output_tokens("s", 2)[1]
    sched, worker, clock = make()
    sched.add_request(submit("s", 5, 10, stop_token_ids=[stop], ignore_eos=True))
    run = drive(sched, worker, clock)
    assert run.tokens("s") == _first_output_tokens("s", 2)
    assert run.final("s").finish_reason == "stop"


def test_max_model_len_ends_with_length() -> None:
    sched, worker, clock = make(max_model_len=12)
    sched.add_request(submit("m", 8, 100))
    run = drive(sched, worker, clock)
    final = run.final("m")
    assert final.finish_reason == "length"
    assert final.num_prompt_tokens + final.num_output_tokens == 12


def test_kv_pool_smaller_than_max_model_len_caps_a_lone_request() -> None:
    # 3 blocks of 4: 12 computed positions + the last sampled token, then "length"
    sched, worker, clock = make(num_blocks=3, block_size=4, max_model_len=100)
    sched.add_request(submit("big", 5, 100))
    run = drive(sched, worker, clock)
    assert run.final("big").finish_reason == "length"
    assert len(run.tokens("big")) == 13 - 5


def test_outputs_carry_counts_and_final_timings() -> None:
    sched, worker, clock = make()
    sched.add_request(submit("t", 6, 3))
    run = drive(sched, worker, clock, step_time=0.5)
    outs = run.outputs["t"]
    assert len(outs) == 3 and outs[-1].num_output_tokens == 3 and outs[-1].num_prompt_tokens == 6
    assert all(o.timings is None and o.finish_reason is None for o in outs[:-1])
    t = outs[-1].timings
    assert t is not None and t.arrival == 1000.0 and t.first_scheduled == 1000.0
    assert t.first_token == 1000.5 and t.finished == 1001.5 and t.num_preemptions == 0


def test_logprobs_reach_only_requests_that_asked() -> None:
    sched, _, _ = make()
    sched.add_request(submit("lp", 3, 2, logprobs=1))
    sched.add_request(submit("no", 3, 2))
    plan = sched.schedule()
    assert plan is not None
    lp = TokenLogprobs(-0.25, [7], [-0.25])
    batch = sched.update(StepResult(plan.step_id, [7, 8], {"lp": lp}))  # batch order: lp, no
    assert batch.rids == ["lp", "no"] and batch.token_ids == [7, 8] and batch.logprobs == {"lp": lp}
    by_rid = {o.rid: o for o in batch.as_outputs()}
    assert by_rid["lp"].logprobs == [lp] and by_rid["no"].logprobs == []


# ---- abort -----------------------------------------------------------------------------------


def test_abort_waiting_running_and_unknown_is_idempotent() -> None:
    sched, worker, _ = make(max_num_seqs=1, max_num_batched_tokens=8)
    sched.add_request(submit("run", 4, 5))
    sched.add_request(submit("wait", 4, 5))
    plan = sched.schedule()
    assert plan is not None
    sched.update(worker.execute(plan))
    assert worker.steps[-1].rids == ["run"]
    out = sched.abort_request("wait")
    assert out is not None and out.finish_reason == "abort" and out.timings is not None
    out = sched.abort_request("run")
    assert out is not None and out.num_output_tokens == 1
    assert sched.pool.num_used == 0  # freed in the same step
    assert sched.abort_request("run") is None and sched.abort_request("nope") is None
    assert sched.schedule() is None
    sched.check_invariants()


def test_abort_while_plan_in_flight_ignores_its_token_and_releases_it() -> None:
    sched, worker, _ = make()
    sched.add_request(submit("a", 4, 5))
    sched.add_request(submit("b", 4, 5))
    plan = sched.schedule()
    assert plan is not None
    assert sched.abort_request("a") is not None
    outs = sched.update(worker.execute(plan))
    assert [o.rid for o in outs.as_outputs()] == ["b"]
    plan2 = sched.schedule()
    assert plan2 is not None and plan2.released_slots == [plan.new_seqs[0].slot]
    sched.update(worker.execute(plan2))
    assert worker.steps[-1].released_rids == ["a"] and worker.steps[-1].rids == ["b"]
    sched.check_invariants()


def test_fail_all_ends_every_live_request_with_the_code() -> None:
    sched, worker, _ = make(max_num_seqs=1, max_num_batched_tokens=8)
    sched.add_request(submit("a", 4, 5))
    sched.add_request(submit("b", 4, 5))
    sched.schedule()
    outs = sched.fail_all(ErrorCode.WORKER_FAILED, "worker died")
    assert sorted(o.rid for o in outs) == ["a", "b"]
    assert all(o.finish_reason == "error" and o.error_code == ErrorCode.WORKER_FAILED for o in outs)
    assert not sched.has_work() and sched.pool.num_used == 0
    sched.check_invariants()


@pytest.mark.parametrize("token_ids", [[9], [9, 9, 9]])
def test_a_result_with_the_wrong_number_of_tokens_fails_the_step_samplers(
    token_ids: list[int],
) -> None:
    """Tokens map to sequences by position: with one too few or too many the scheduler cannot
    tell whose token is whose, so every request that sampled in the step fails; a request
    that did not sample (a prefill chunk) and the engine go on."""
    sched, worker, _ = make(max_num_batched_tokens=10, chunk_size=8)
    sched.add_request(submit("a", 4, 5))
    sched.add_request(submit("b", 4, 5))
    sched.add_request(submit("c", 12, 5))  # 8 of 12 prompt tokens this step: no sample
    plan = sched.schedule()
    assert plan is not None
    worker.execute(plan)  # the worker holds the batch; its answer is replaced by a bad one
    outs = sched.update(StepResult(plan.step_id, token_ids))
    assert sorted(o.rid for o in outs.finished) == ["a", "b"] and outs.rids == []
    assert all(o.error_code == ErrorCode.WORKER_FAILED for o in outs.finished)
    assert "2 sequences that sampled" in (outs.finished[0].error_message or "")
    sched.check_invariants()
    plan = sched.schedule()  # the next plan releases a and b; c goes on
    assert plan is not None and len(plan.released_slots) == 2
    last = None
    while plan is not None:
        outs = sched.update(worker.execute(plan))
        sched.check_invariants()
        last = outs.finished or last
        plan = sched.schedule()
    assert last is not None and last[0].rid == "c" and last[0].finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True])
def test_result_for_the_wrong_step_is_refused(overlap: bool) -> None:
    """Also: schedule() refuses to send more plans than may be in flight (one without async
    scheduling, two with it)."""
    sched, _, _ = make(async_scheduling=overlap)
    sched.add_request(submit("a", 4, 5))
    plan = sched.schedule()
    assert plan is not None
    with pytest.raises(ValueError, match="but step 1 is next"):
        sched.update(StepResult(plan.step_id + 1, [], []))
    for _ in range(sched.config.max_plans_in_flight - 1):
        assert sched.schedule() is not None  # async: plan 2 assumes "a" goes on
    with pytest.raises(RuntimeError):
        sched.schedule()


# ---- the plan --------------------------------------------------------------------------------


def test_running_requests_send_only_new_blocks_and_no_tokens() -> None:
    sched, worker, _ = make(block_size=4)
    sched.add_request(submit("a", 6, 8))
    plans = []
    for _ in range(5):
        plan = sched.schedule()
        assert plan is not None
        plans.append(plan)
        outs = sched.update(worker.execute(plan))
    first = plans[0]
    assert [s.rid for s in first.new_seqs] == ["a"] and first.new_seqs[0].block_ids == [0, 1]
    slot = first.new_seqs[0].slot
    assert first.prev_step_id is None  # the first plan resets the worker's batch
    assert first.count_slots == [slot] and first.counts == [6] and first.block_ids == []
    # positions 6, 7 fit in block 1; position 8 needs a new block, sent once
    assert [p.block_ids for p in plans[1:]] == [[], [], [2], []]
    assert [p.block_slots for p in plans[1:]] == [[], [], [slot], []]
    # a decode is the default: no new sequence, no count, no token (the worker's own sample)
    assert all(p.new_seqs == [] and p.count_slots == [] for p in plans[1:])
    assert [p.prev_step_id for p in plans[1:]] == [p.step_id for p in plans[:-1]]
    assert [s.start_positions for s in worker.steps[1:]] == [[6], [7], [8], [9]]
    assert worker.steps[2].token_ids() == [token_for("a", 1, 1000)]
    assert outs.rids == ["a"] and outs.token_ids == [token_for("a", 4, 1000)] and not outs.finished


def test_chunked_prefill_samples_only_after_the_last_chunk() -> None:
    sched, worker, _ = make(chunk_size=4, max_num_batched_tokens=16)
    sched.add_request(submit("a", 10, 2))
    sizes, samples = [], []
    for _ in range(3):
        plan = sched.schedule()
        assert plan is not None
        sched.update(worker.execute(plan))
        sizes.append(worker.steps[-1].num_tokens[0])
        samples.append(worker.steps[-1].sample[0])
    assert sizes == [4, 4, 2] and samples == [False, False, True]


def test_step_record_describes_the_step() -> None:
    sched, worker, _ = make(chunk_size=8, max_num_batched_tokens=16)
    sched.add_request(submit("d", 3, 5))
    plan = sched.schedule()
    assert plan is not None
    sched.update(worker.execute(plan))
    sched.add_request(submit("p", 20, 5))
    sched.schedule()
    rec = last_record(sched)
    assert rec is not None and rec.rids == ["d", "p"] and rec.num_tokens == [1, 8]
    assert rec.is_prefill == [False, True]
    assert rec.num_prefill_tokens == 8 and rec.num_decode_tokens == 1
    assert rec.num_running == 2 and rec.num_waiting == 0
    assert rec.num_kv_blocks_used == 1 + 2 and rec.to_dict()["num_kv_blocks_total"] == 64


# ---- block pool ------------------------------------------------------------------------------


def test_block_pool_allocates_frees_and_checks_itself() -> None:
    pool = BlockPool(8, 16, watermark=0.25)
    a = pool.allocate(3)
    b = pool.allocate(1)
    assert a == [0, 1, 2] and b == [3] and pool.num_free == 4
    assert pool.allocate(5) is None and pool.num_free == 4
    assert pool.can_allocate(2, keep_watermark=True)
    assert not pool.can_allocate(3, keep_watermark=True)
    assert pool.can_allocate(4, keep_watermark=False)
    pool.check_invariants([a, b])
    with pytest.raises(AssertionError, match="!= total"):
        pool.check_invariants([a])  # b's block is neither free nor owned (a leak)
    with pytest.raises(AssertionError, match="owned by 2"):
        pool.check_invariants([a, b, [3]])
    pool.free(a)
    assert pool.num_free == 7 and pool.allocate(1) == [0]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([5])


def test_blocks_needed_rounds_up() -> None:
    pool = BlockPool(8, 4)
    assert pool.blocks_needed(0, 1) == 1 and pool.blocks_needed(0, 4) == 1
    assert pool.blocks_needed(1, 5) == 1 and pool.blocks_needed(2, 5) == 0


# ---- import hygiene --------------------------------------------------------------------------


def test_importing_the_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys, services.scheduler, services.scheduler.scheduler; "
        "print('torch' in sys.modules, 'triton' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    assert out.stdout.split() == ["False", "False"]


def test_run_helper_sees_exactly_one_final_output_per_request() -> None:
    sched, worker, clock = make()
    for i in range(5):
        sched.add_request(submit(f"r{i}", 3 + i, 2 + i))
    run: Run = drive(sched, worker, clock)
    assert sorted(run.outputs) == [f"r{i}" for i in range(5)]
    for i in range(5):
        assert run.final(f"r{i}").num_output_tokens == 2 + i
