"""Overlap scheduling (`async_scheduling`) against a worker that answers out of phase.

The scheduler may send plan N+1 before result N arrives; the checking worker runs every plan at
once, in order (as the real one does), but its results reach the scheduler one plan late
whenever the drawn phase says so. Random configs, workloads, aborts (also while two plans are in
flight), small pools (preemption while a sample is in flight) and end-of-sequence tokens (an
extra, discarded step). After every call: integrity (pool bookkeeping; the checking worker
verifies every context it reads, so a block used by two requests at once fails), the token
budget. At the end: each request finished exactly once with exactly the tokens the model gives
(no token lost, none emitted twice), and no block leaked. ~10 s.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_scheduler_properties import (
    EOS,
    VOCAB,
    Arrival,
    _check_final,
    arrivals,
    configs,
)
from test_scheduler_support import (
    CheckingWorker,
    FakeClock,
    Run,
    arrive,
    check_composition,
    drive,
    make,
    submit,
)

from services.scheduler import Scheduler, SchedulerConfig
from shared.protocol.worker_channel import StepResult


def _run_out_of_phase(
    sched: Scheduler,
    worker: CheckingWorker,
    workload: list[Arrival],
    phases: list[bool],
    clock: FakeClock,
) -> tuple[Run, dict[str, Arrival]]:
    """Each round: arrivals, then plans while the scheduler may send one (a second one only
    when this round's phase says "ahead"), then one result delivered."""
    run = Run()
    admitted: dict[str, Arrival] = {}
    results: deque[StepResult] = deque()  # executed by the worker, not yet delivered
    last_arrival = max(a.step for a in workload)
    for step in range(4000):
        admitted.update(arrive(sched, workload, step, False, run))
        ahead = phases[step % len(phases)]
        while sched.can_schedule() and (ahead or not results):
            plan = sched.schedule()
            sched.check_invariants()
            check_composition(sched, plan)
            if plan is None:
                break
            assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
            results.append(worker.execute(plan))  # the worker runs plans in order, at once
            if len(results) == 2:
                event("two plans in flight")
            arrive(sched, workload, step, True, run)  # aborts while in flight
        if results:
            run.add(sched.update(results.popleft()))
            sched.check_invariants()
        elif step > last_arrival and not sched.has_work():
            break
        clock.advance(max(0.01, sched.next_timeout() or 0.0) if not results else 0.01)
    assert not results and len(sched.in_flight) == 0
    return run, admitted


def _arrival(step: int, max_tokens: int, priority: int) -> Arrival:
    return Arrival(step, 1, max_tokens, priority, False, None, False)


# Found by hypothesis: r5 is preempted with its first sample in flight and readmitted at once,
# twice; its old sample (index 1, from before the second preemption) lands after the second
# readmission has recomputed past it and was once taken for index 2.
_TWICE_READMITTED = dict(
    config=SchedulerConfig(
        max_num_seqs=1,
        max_num_batched_tokens=2,
        chunk_size=2,
        max_waiting=5,
        policy="priority",
        watermark=0.0,
        batch_timeout=0.0,
        max_wait=0.05,
    ),  # fmt: skip
    caching=False,
    num_blocks=3,
    block_size=1,
    max_model_len=4,
    workload=[_arrival(0, 1, 0)] * 4
    + [_arrival(3, 1, 1), _arrival(6, 2, 0), _arrival(0, 1, 0), _arrival(1, 2, 1)],
    phases=[True],
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(**_TWICE_READMITTED)
@given(
    config=configs(),
    caching=st.booleans(),
    num_blocks=st.integers(3, 10) | st.integers(11, 40),  # small: preemption
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_model_len=st.integers(4, 80),
    workload=st.lists(arrivals, min_size=1, max_size=14),
    phases=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_out_of_phase_results_keep_every_invariant(
    config: SchedulerConfig,
    caching: bool,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    workload: list[Arrival],
    phases: list[bool],
) -> None:
    config = SchedulerConfig(
        **{**_fields(config), "async_scheduling": True, "enable_prefix_caching": caching}
    )
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, block_size, max_model_len, [EOS], clock=clock)
    worker = CheckingWorker(num_blocks, block_size, vocab_size=VOCAB, max_model_len=max_model_len)
    run, admitted = _run_out_of_phase(sched, worker, workload, phases, clock)
    assert not sched.has_work(), "work left after 4000 rounds"
    assert sched.pool.num_used == 0 and sched.pool.num_free == num_blocks  # no leak
    assert set(run.outputs) <= set(admitted)
    event(f"preempted: {sched.stats()['num_preemptions'] > 0}")
    event(f"composition: {config.step_composition}")
    for rid, a in admitted.items():
        event(f"{config.batching} finish: {run.final(rid).finish_reason}")
        _check_final(run, rid, a, min(max_model_len, num_blocks * block_size + 1))


def _fields(config: SchedulerConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__slots__}


def test_a_finished_request_runs_one_extra_step_and_is_released_after_it() -> None:
    """`a` samples its stop token in step 2; plan 3, built before result 2 arrived, computes it
    once more (its token is dropped); plan 4, built after result 2, releases its slot, and its
    blocks may go to `b` from plan 4 on (the worker has run step 3 by then)."""
    sched, worker, clock = make(
        num_blocks=4, block_size=4, eos=(), async_scheduling=True, enable_prefix_caching=False
    )
    sched.add_request(submit("a", 3, 10, stop_token_ids=[_second_token("a")]))
    plan1 = sched.schedule()  # a's prompt; samples output 0
    assert plan1 is not None and sched.can_schedule()
    r1 = worker.execute(plan1)
    plan2 = sched.schedule()  # assumes a goes on: decodes output 0, samples output 1
    assert plan2 is not None and not sched.can_schedule()
    r2 = worker.execute(plan2)
    out1 = sched.update(r1)
    assert out1.rids == ["a"] and not out1.finished
    plan3 = sched.schedule()  # a still computing its (last) decode: held, sampled in flight
    assert plan3 is not None
    r3 = worker.execute(plan3)
    out2 = sched.update(r2)  # output 1 is the stop token: a finishes
    assert [o.rid for o in out2.finished] == ["a"] and out2.finished[0].finish_reason == "stop"
    sched.add_request(submit("b", 8, 2))
    plan4 = sched.schedule()  # releases a's slot; b may take a's blocks now: step 3 ran first
    assert plan4 is not None and plan4.released_slots == [plan1.new_seqs[0].slot]
    r4 = worker.execute(plan4)
    out3 = sched.update(r3)  # a's extra, discarded token
    assert out3.rids == [] and out3.finished == [] and out3.token_ids == []
    run = Run()
    run.add(out1)
    run.add(out2)
    run.add(out3)
    run.add(sched.update(r4))
    sched.check_invariants()
    drive(sched, worker, clock, run=run)
    assert run.tokens("a") == [r1.token_ids[0], r2.token_ids[0]]
    assert len(run.tokens("b")) == 2 and sched.pool.num_used == 0


def _second_token(rid: str) -> int:
    from test_scheduler_support import token_for

    return token_for(rid, 1, 1000)
