"""Scheduler core after worker faults (issue 14): a lost worker's requests restart by recompute
and produce exactly the tokens of an undisturbed run; past the retry limit they fail; a failed
step fails only its own requests, never waiting ones, and the worker is told to drop them."""

from __future__ import annotations

from test_scheduler_support import CheckingWorker, Run, drive, make, submit

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
    # The same worker reconnecting still holds the old state: the next plan releases it (the
    # checking worker asserts a rid is never sent as new while it holds it).
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
    assert plan is not None
    # a fresh worker ignores releases of rids it never held (the real ones do: pop(rid, None))
    fresh.seqs.update({rid: worker.seqs[rid] for rid in plan.released_rids})
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


def test_a_failed_step_fails_its_requests_only_and_releases_them() -> None:
    sched, worker, clock = make(max_num_seqs=2, max_num_batched_tokens=64)
    _submit_all(sched)
    run = Run()
    _steps(sched, worker, run, 2)
    plan = sched.schedule()
    assert plan is not None and sorted(plan.rids) == ["r0", "r1"]
    outs = sched.fail_step(plan.rids, ErrorCode.WORKER_FAILED, "step failed")
    assert sorted(o.rid for o in outs) == ["r0", "r1"]
    assert sched.pool.num_used == 0
    nxt = sched.schedule()
    assert nxt is not None and sorted(nxt.released_rids) == ["r0", "r1"]
    run.add(outs)
    run.add(sched.update(worker.execute(nxt)))
    drive(sched, worker, clock, run=run)
    for rid in RIDS[2:]:
        assert run.final(rid).error_code is None and len(run.tokens(rid)) == 12
    assert not {"r0", "r1"} & set(worker.seqs)  # the worker dropped the failed ones
