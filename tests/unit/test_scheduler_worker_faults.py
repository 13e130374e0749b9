"""Scheduler core after worker faults (issue 14): a lost worker's requests restart by recompute
and produce exactly the tokens of an undisturbed run; past the retry limit they fail; a failed
step fails only the requests it is pinned on (bisection), never waiting ones, and the worker is
told to drop every request that ends."""

from __future__ import annotations

import pytest
from test_scheduler_support import CheckingWorker, Run, drive, last_record, make, submit

from shared.protocol.errors import ErrorCode

RIDS = [f"r{n}" for n in range(6)]


def _submit_all(sched) -> None:  # type: ignore[no-untyped-def]
    for n, rid in enumerate(RIDS):
        assert sched.add_request(submit(rid, 5 + n, 12)) is None


def _steps(sched, worker, run: Run, num_steps: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(num_steps):
        plan = sched.schedule()
        assert plan is not None
        run.add(sched.update(worker.execute(plan)))


def _undisturbed() -> Run:
    sched, worker, clock = make(max_num_seqs=4, max_num_batched_tokens=64)
    _submit_all(sched)
    return drive(sched, worker, clock)


def test_requeue_recomputes_to_the_same_tokens_and_frees_every_block() -> None:
    want = _undisturbed()
    sched, worker, clock = make(max_num_seqs=4, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    _steps(sched, worker, run, 4)
    assert sched.schedule() is not None  # a plan in flight when the worker dies: never answered
    assert sched.requeue_all(3, ErrorCode.WORKER_FAILED, "lost") == []
    assert sched.pool.num_used == 0
    # The same worker reconnecting still holds the old state: the next plan resets its batch
    # (the checking worker asserts a rid is never sent as new while it holds it).
    drive(sched, worker, clock, run=run)
    for rid in RIDS:
        assert run.tokens(rid) == want.tokens(rid), rid  # nothing lost, nothing repeated
        assert run.final(rid).error_code is None
    assert sched.pool.num_used == 0  # (finished rids are released with the next plan)


def test_a_fresh_worker_gets_every_requeued_request_as_new() -> None:
    want = _undisturbed()
    sched, worker, clock = make(max_num_seqs=4, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    _steps(sched, worker, run, 3)
    sched.requeue_all(3, ErrorCode.WORKER_FAILED, "lost")
    fresh = CheckingWorker(64, worker.block_size)
    plan = sched.schedule()
    assert plan is not None and plan.prev_step_id is None  # a reset: any worker may take it
    assert sorted(s.rid for s in plan.new_seqs) == sorted(fresh.peek(plan).rids)
    run.add(sched.update(fresh.execute(plan)))
    drive(sched, fresh, clock, run=run)
    for rid in RIDS:
        assert run.tokens(rid) == want.tokens(rid), rid


def test_retries_exhausted_fail_only_requests_the_worker_held() -> None:
    sched, worker, clock = make(max_num_seqs=2, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    _steps(sched, worker, run, 2)  # r0, r1 run; r2..r5 wait
    outs = sched.requeue_all(0, ErrorCode.WORKER_FAILED, "lost once too often")
    assert sorted(o.rid for o in outs) == ["r0", "r1"]
    assert all(o.error_code == ErrorCode.WORKER_FAILED for o in outs)
    run.add(outs)
    drive(sched, worker, clock, run=run)  # the worker reconnected: it drops r0, r1
    for rid in RIDS[2:]:
        assert run.final(rid).error_code is None and len(run.tokens(rid)) == 12


def test_a_failed_step_of_one_request_fails_it_and_resets_the_worker_batch() -> None:
    sched, worker, clock = make(max_num_seqs=1, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    _steps(sched, worker, run, 2)
    plan = sched.schedule()
    assert plan is not None and worker.peek(plan).rids == ["r0"]
    worker.held.fail()  # the worker failed the step: its batch needs a reset
    outs = sched.bisect_failed_step(ErrorCode.WORKER_FAILED, "step failed")
    assert [o.rid for o in outs] == ["r0"]
    assert sched.pool.num_used == 0
    nxt = sched.schedule()
    assert nxt is not None and nxt.prev_step_id is None  # the next plan resets the batch
    assert "r0" not in {s.rid for s in nxt.new_seqs}
    run.add(outs)
    run.add(sched.update(worker.execute(nxt)))
    drive(sched, worker, clock, run=run)
    for rid in RIDS[1:]:
        assert run.final(rid).error_code is None and len(run.tokens(rid)) == 12
    assert "r0" not in worker.seqs  # the worker dropped the failed one


class _FaultyWorker(CheckingWorker):
    """A checking worker that fails every step computing one of `poisoned` (from `from_token`
    generated tokens on), before touching its state (the next plan resets its batch)."""

    def __init__(self, poisoned: set[str], from_token: int = 0, **kw: int) -> None:
        super().__init__(**kw)
        self.poisoned = poisoned
        self.from_token = from_token
        self.num_failed = 0

    def fails(self, plan) -> bool:  # type: ignore[no-untyped-def]
        for rid in set(self.peek(plan).rids) & self.poisoned:
            seq = self.seqs.get(rid)
            num_generated = 0 if seq is None else len(seq.token_ids) - seq.num_prompt_tokens
            if num_generated >= self.from_token:
                return True
        return False

    def run(self, sched, plan, run: Run) -> None:  # type: ignore[no-untyped-def]
        """One plan through the worker, or its failure through bisection."""
        if self.fails(plan):
            self.num_failed += 1
            run.add(sched.bisect_failed_step(ErrorCode.WORKER_FAILED, "boom"))
            return
        run.add(sched.update(self.execute(plan)))
        sched.step_completed(self.steps[-1].rids)


def _drive_with_faults(sched, worker: _FaultyWorker, clock) -> Run:  # type: ignore[no-untyped-def]
    run = Run()
    for _ in range(2000):
        sched.release_held_if_idle()
        plan = sched.schedule()
        sched.check_invariants()
        if plan is None:
            assert not sched.has_work(), "stuck: work left, nothing scheduled"
            return run
        clock.advance(0.01)
        worker.run(sched, plan, run)
        sched.check_invariants()
    raise AssertionError("not done after 2000 steps")


@pytest.mark.parametrize("from_token", [0, 5], ids=["at-prefill", "mid-decode"])
@pytest.mark.parametrize("culprit", ["r0", "r3", "r5"])
def test_bisection_fails_only_the_culprit(culprit: str, from_token: int) -> None:
    want = _undisturbed()
    sched, _, clock = make(max_num_seqs=4, max_num_batched_tokens=64)
    worker = _FaultyWorker({culprit}, from_token, num_blocks=64, block_size=4)
    _submit_all(sched)
    run = _drive_with_faults(sched, worker, clock)
    assert run.final(culprit).error_code == ErrorCode.WORKER_FAILED
    for rid in RIDS:
        if rid != culprit:  # the innocent recompute to exactly their undisturbed tokens
            assert run.final(rid).error_code is None, rid
            assert run.tokens(rid) == want.tokens(rid), rid
    assert 1 <= worker.num_failed <= 6  # ~log2(4) + 1 failures, not one per step
    assert sched.pool.num_used == 0 and sched.faults.num_held == 0
    assert sched.add_request(submit("late", 4, 2)) is None  # releases go out with a next plan
    _drive_with_faults(sched, worker, clock)
    assert culprit not in worker.seqs  # the worker dropped the failed request's state


def test_bisection_ends_even_when_every_step_fails() -> None:
    sched, _, clock = make(max_num_seqs=4, max_num_batched_tokens=64)
    worker = _FaultyWorker(set(RIDS), num_blocks=64, block_size=4)
    _submit_all(sched)
    run = _drive_with_faults(sched, worker, clock)
    assert all(run.final(rid).error_code == ErrorCode.WORKER_FAILED for rid in RIDS)
    assert sched.pool.num_used == 0


def test_a_held_request_can_be_aborted() -> None:
    sched, _, _ = make(max_num_seqs=4, max_num_batched_tokens=64)
    _submit_all(sched)
    plan = sched.schedule()
    record = last_record(sched)
    assert plan is not None and record is not None and len(record.rids) == 4
    assert sched.bisect_failed_step(ErrorCode.WORKER_FAILED, "boom") == []
    held = [rid for rid in record.rids if sched.faults.is_held(sched.live.get(rid))]
    assert len(held) == 2 and sched.faults.num_held == 2
    assert sched.abort_request(held[0]) is not None
    assert sched.faults.num_held == 1
    sched.check_invariants()


def test_dynamic_batching_fails_the_whole_step() -> None:
    """A dynamic batch cannot recompute part of itself: no bisection, as documented."""
    sched, _, _ = make(max_num_seqs=4, max_num_batched_tokens=64, batching="dynamic",
                       batch_size=4)  # fmt: skip
    _submit_all(sched)
    plan = sched.schedule()
    record = last_record(sched)
    assert plan is not None and record is not None and len(record.rids) == 4
    outs = sched.bisect_failed_step(ErrorCode.WORKER_FAILED, "boom")
    assert sorted(o.rid for o in outs) == sorted(record.rids) and sched.faults.num_held == 0
    sched.check_invariants()


def test_a_request_preempted_before_the_worker_is_lost_keeps_every_token() -> None:
    """Its preemption was noted at a version of the old core's running set; the new core's
    versions start again from 0, so the note must go, or the new core's samples for it are
    dropped while the worker keeps them (found by tests/e2e/test_structured_faults.py)."""
    want = _undisturbed()
    sched, worker, clock = make(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    for _ in range(40):
        _steps(sched, worker, run, 1)
        if sched.stats()["num_preemptions"] > 0:
            break
    assert sched.stats()["num_preemptions"] > 0  # the pool is too small for the batch
    _steps(sched, worker, run, 2)
    assert sched.requeue_all(3, ErrorCode.WORKER_FAILED, "lost") == []
    drive(sched, worker, clock, run=run)
    for rid in RIDS:
        assert run.tokens(rid) == want.tokens(rid), rid
