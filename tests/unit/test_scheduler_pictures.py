"""The seeds' pictures as tests: continuous vs dynamic vs static batching, the mixed step,
recompute after preemption losing nothing, short-first aging, priority order."""

from __future__ import annotations

import pytest
from test_scheduler_support import Run, drive, last_record, make, submit

from shared.protocol.worker_channel import StepPlan


def _finish_step(run: Run, plans: list[StepPlan], rid: str) -> int:
    """Index into `plans` of the step whose result finished `rid`."""
    final = run.final(rid)
    steps_with_sample = [i for i, p in enumerate(plans) if rid in p.rids]
    last = steps_with_sample[-1]
    assert final.num_output_tokens >= 1
    return last


def _first_step(plans: list[StepPlan], rid: str) -> int:
    return next(i for i, p in enumerate(plans) if rid in p.rids)


def _three_and_one(batching: str) -> tuple[Run, list[StepPlan]]:
    sched, worker, clock = make(
        max_num_seqs=3, max_num_batched_tokens=16, chunk_size=16, batching=batching
    )
    sched.add_request(submit("a", 4, 8))
    sched.add_request(submit("b", 4, 3))  # finishes first
    sched.add_request(submit("c", 4, 6))
    sched.add_request(submit("d", 4, 4))  # waits for a slot
    run = drive(sched, worker, clock)
    return run, run.plans


def test_continuous_a_waiting_request_computes_the_step_after_a_slot_frees() -> None:
    run, plans = _three_and_one("continuous")
    k = _finish_step(run, plans, "b")
    assert "d" not in plans[k].rids
    assert "d" in plans[k + 1].rids and "b" not in plans[k + 1].rids
    assert plans[k + 1].released_rids == ["b"]
    assert all(len(p.rids) == 3 for p in plans[: k + 2])  # the batch stays full


def test_static_the_batch_runs_until_its_longest_request_is_done() -> None:
    run, plans = _three_and_one("static")
    last = _finish_step(run, plans, "a")  # a is the longest
    assert _first_step(plans, "d") == last + 1
    # b finished early but keeps its slot and keeps being computed (padding) until a is done
    b_done = run.final("b").num_output_tokens
    assert b_done == 3
    assert all("b" in p.rids for p in plans[: last + 1])
    assert set(plans[last + 1].released_rids) == {"a", "b", "c"}
    assert run.tokens("d") and run.final("d").finish_reason == "length"


def test_dynamic_finished_requests_leave_but_nobody_joins_until_it_drains() -> None:
    run, plans = _three_and_one("dynamic")
    k = _finish_step(run, plans, "b")
    assert all("b" not in p.rids for p in plans[k + 1 :])
    last = _finish_step(run, plans, "a")
    assert _first_step(plans, "d") == last + 1
    assert len(plans[k + 1].rids) == 2  # the batch shrinks as members finish


def test_dynamic_partial_batch_forms_after_the_timeout() -> None:
    sched, worker, clock = make(max_num_seqs=4, batching="dynamic", batch_timeout=0.5)
    sched.add_request(submit("a", 4, 2))
    assert sched.schedule() is None
    timeout = sched.next_timeout()
    assert timeout is not None and abs(timeout - 0.5) < 1e-9
    clock.advance(0.25)
    assert sched.schedule() is None
    clock.advance(0.25)
    plan = sched.schedule()
    assert plan is not None and worker.peek(plan).rids == ["a"]
    sched.update(worker.execute(plan))


def test_dynamic_full_batch_forms_at_once() -> None:
    sched, worker, _ = make(max_num_seqs=4, batch_size=2, batching="dynamic", batch_timeout=10.0)
    sched.add_request(submit("a", 4, 2))
    sched.add_request(submit("b", 4, 2))
    sched.add_request(submit("c", 4, 2))
    plan = sched.schedule()
    assert plan is not None and worker.peek(plan).rids == ["a", "b"]


def test_mixed_step_holds_a_prefill_chunk_and_every_running_decode() -> None:
    sched, worker, clock = make(max_num_seqs=4, max_num_batched_tokens=12, chunk_size=8)
    for rid in ("x", "y", "z"):
        sched.add_request(submit(rid, 3, 30))
    run = Run()
    for _ in range(2):  # prefill x, y, z, then one decode step
        plan = sched.schedule()
        assert plan is not None
        run.add(sched.update(worker.execute(plan)))
    sched.add_request(submit("long", 40, 2))
    chunks = []
    while True:
        plan = sched.schedule()
        assert plan is not None
        rec = last_record(sched)
        assert rec is not None
        decodes = [r for r, p in zip(rec.rids, rec.is_prefill, strict=True) if not p]
        assert sorted(decodes) == ["x", "y", "z"]  # every running decode, every step
        assert plan.num_scheduled_tokens <= 12
        i = worker.peek(plan).rids.index("long")
        chunks.append(worker.peek(plan).num_tokens[i])
        run.add(sched.update(worker.execute(plan)))
        if worker.peek(plan).sample[i]:
            break
    assert sum(chunks) == 40 and len(chunks) == 5 and max(chunks) <= 8
    assert chunks[:4] == [8, 8, 8, 8]  # 12-token budget: 3 decodes + an 8-token chunk


def _kv_workload(sched_kw: dict[str, object], num_blocks: int) -> tuple[Run, object]:
    sched, worker, clock = make(num_blocks=num_blocks, block_size=4, max_model_len=512, **sched_kw)
    for i in range(24):
        assert sched.add_request(submit(f"r{i}", 10 + (i * 7) % 23, 20 + (i * 5) % 17)) is None
    resumed_not_sampled: set[str] = set()

    run = Run()
    for _ in range(5000):
        plan = sched.schedule()
        sched.check_invariants()
        if plan is None:
            break
        for rid in worker.peek(plan).released_rids:  # a preempted request was just resumed: thrash
            # released while still live means preempted (not finished)
            preempted = sched.is_live(rid)
            assert not (preempted and rid in resumed_not_sampled), f"{rid} preempted at once"
        for seq in plan.new_seqs:
            if len(seq.token_ids) > seq.num_prompt_tokens:
                resumed_not_sampled.add(seq.rid)
        result = worker.execute(plan)
        resumed_not_sampled.difference_update(s.rid for s in worker.peek(plan).sampled())
        run.add(sched.update(result))
        sched.check_invariants()
    assert not sched.has_work()
    return run, sched


def test_three_times_the_kv_capacity_completes_and_recompute_loses_nothing() -> None:
    # 24 requests of ~20 prompt + ~28 output tokens need ~290 blocks of 4 at once;
    # 96 blocks is about a third of that.
    kw = {"max_num_seqs": 24, "max_num_batched_tokens": 64, "chunk_size": 16, "watermark": 0.0}
    ample, _ = _kv_workload(kw, num_blocks=2048)
    tight, sched = _kv_workload(kw, num_blocks=96)
    assert sched.stats()["num_preemptions"] > 0  # the tight run really preempted
    for i in range(24):
        rid = f"r{i}"
        assert tight.tokens(rid) == ample.tokens(rid)
        assert tight.final(rid).finish_reason == ample.final(rid).finish_reason == "length"
    assert sum(tight.num_preemptions(f"r{i}") for i in range(24)) > 0


def _long_prompt_wait(max_wait: float, step_time: float = 0.05) -> float:
    """Seconds a 40-token prompt waits under short-first while a 4-token request arrives every
    step and the single slot frees every step (each short one needs one step)."""
    sched, worker, clock = make(
        max_num_seqs=1,
        max_num_batched_tokens=64,
        chunk_size=64,
        policy="short-first",
        max_wait=max_wait,
    )
    sched.add_request(submit("long", 40, 2))
    arrival = clock()
    for i in range(100):
        sched.add_request(submit(f"short-{i}", 4, 1))
        plan = sched.schedule()
        assert plan is not None
        if "long" in worker.peek(plan).rids:
            return clock() - arrival
        clock.advance(step_time)
        sched.update(worker.execute(plan))
        sched.check_invariants()
    return float("inf")


def test_short_first_without_aging_starves_a_long_prompt() -> None:
    assert _long_prompt_wait(max_wait=1e9) == float("inf")


def test_short_first_ages_a_long_prompt_past_max_wait() -> None:
    wait = _long_prompt_wait(max_wait=1.0)
    assert 1.0 - 1e-9 <= wait <= 1.0 + 0.05 + 1e-9  # at most one step past max_wait


def test_priority_runs_lower_values_first_ties_by_arrival() -> None:
    sched, worker, clock = make(max_num_seqs=1, max_num_batched_tokens=8, policy="priority")
    sched.add_request(submit("late-low", 3, 1, priority=5))
    sched.add_request(submit("first-high", 3, 1, priority=0))
    sched.add_request(submit("second-high", 3, 1, priority=0))
    sched.add_request(submit("mid", 3, 1, priority=2))
    run = drive(sched, worker, clock)
    order = [p.rids[0] for p in run.plans]
    assert order == ["first-high", "second-high", "mid", "late-low"]


def test_fcfs_preempts_the_latest_arrival_and_resumes_it_first() -> None:
    # 2 requests that each grow to 6 blocks in an 8-block pool: the later one must yield.
    sched, worker, clock = make(num_blocks=8, block_size=4, max_num_seqs=2, watermark=0.0)
    sched.add_request(submit("early", 4, 20))
    sched.add_request(submit("late", 4, 20))
    run = drive(sched, worker, clock)
    assert run.num_preemptions("early") == 0
    assert run.num_preemptions("late") >= 1
    assert len(run.tokens("late")) == 20


@pytest.mark.parametrize("caching", [False, True])
def test_a_resumed_request_reaches_the_worker_as_new_with_all_its_tokens(caching: bool) -> None:
    sched, worker, clock = make(
        num_blocks=8, block_size=4, max_num_seqs=2, watermark=0.0, enable_prefix_caching=caching
    )
    sched.add_request(submit("early", 4, 20))
    sched.add_request(submit("late", 4, 20))
    run = Run()
    released_at = resumed = None
    for i in range(200):
        plan = sched.schedule()
        if plan is None:
            break
        if "late" in worker.peek(plan).released_rids and released_at is None:
            released_at = i
            assert sched.is_live("late")  # preempted, not finished
            rec = last_record(sched)
            assert rec is not None and rec.num_preemptions >= 1
        new = [s for s in plan.new_seqs if s.rid == "late"]
        if released_at is not None and new and resumed is None:
            resumed = new[0]
            # with caching its full blocks were kept when it was preempted: the ones that
            # "early" did not need since (deepest evicted first) are hits
            start = worker.peek(plan).start_positions[worker.peek(plan).rids.index("late")]
            if caching:
                assert 0 < start <= len(new[0].token_ids) - 1 and start % 4 == 0
            else:
                assert start == 0
        run.add(sched.update(worker.execute(plan)))
    assert released_at is not None and resumed is not None
    assert resumed.num_prompt_tokens == 4
    produced_before = len(resumed.token_ids) - 4
    assert produced_before > 0
    assert resumed.token_ids[4:] == run.tokens("late")[:produced_before]
    # recomputed in one chunk: its whole table covers every token it holds
    assert len(resumed.block_ids) == -(-len(resumed.token_ids) // 4)


def test_priority_a_full_batch_of_low_priority_does_not_hold_back_a_high_one() -> None:
    sched, worker, clock = make(max_num_seqs=2, max_num_batched_tokens=16, policy="priority")
    sched.add_request(submit("low-a", 4, 50, priority=5))
    sched.add_request(submit("low-b", 4, 50, priority=3))
    run = Run()
    for _ in range(3):
        plan = sched.schedule()
        assert plan is not None
        run.add(sched.update(worker.execute(plan)))
    sched.add_request(submit("high", 4, 3, priority=0))
    plan = sched.schedule()
    assert (
        plan is not None
        and "high" in worker.peek(plan).rids
        and "low-a" not in worker.peek(plan).rids
    )
    assert "low-b" in worker.peek(plan).rids  # only the worst one yields its slot
    run.add(sched.update(worker.execute(plan)))
    run = drive(sched, worker, clock, run=run)
    assert run.num_preemptions("low-a") == 1 and run.num_preemptions("low-b") == 0
    assert len(run.tokens("low-a")) == 50  # it resumed and lost nothing
