"""When a block filled by a prefill chunk becomes findable (~1 s): the plan counts the chunk's
full blocks when it is built (step.py `BuiltStep.filled`), the step's result queues them, and
`after_plan()` (or a lookup that may need them) registers them. So a block is findable once the
step that filled it has completed: not while it is in flight (overlap: a later plan's chunk is
not counted with an earlier result), never when it failed.
"""

from __future__ import annotations

from test_scheduler_support import CheckingWorker, FakeClock, Run

from services.scheduler import Scheduler, SchedulerConfig
from shared.prefix_hash import extend_int_block_keys
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams

PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4 can be looked up
SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _setup(async_scheduling: bool) -> tuple[Scheduler, CheckingWorker]:
    """Blocks of 4, chunks of 8 tokens (2 blocks each), one request "a" with PROMPT."""
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=8, chunk_size=8, async_scheduling=async_scheduling
    )
    sched = Scheduler(config, 32, 4, 128, [], clock=FakeClock(), cache_namespace=b"m")
    assert sched.add_request(SubmitRequest("a", PROMPT, SAMPLING)) is None
    return sched, CheckingWorker(32, 4, vocab_size=50)


def _num_findable(sched: Scheduler) -> int:
    """How many of PROMPT's full blocks a lookup finds now (without flushing anything)."""
    keys: list[int] = []
    extend_int_block_keys(keys, PROMPT, 4, b"m", 4)
    return sched.pool.num_prefix(keys, 4)


def test_with_overlap_a_result_registers_only_the_chunks_its_step_filled() -> None:
    """Two plans in flight, each with a chunk of "a": the first result makes the first chunk's
    2 blocks findable, not the second chunk's (their step has not completed, though "a" has
    computed them as far as the scheduler knows)."""
    sched, worker = _setup(async_scheduling=True)
    first = sched.schedule()
    second = sched.schedule()  # built before the first result arrives
    assert first is not None and second is not None
    results = [worker.execute(first), worker.execute(second)]
    sched.update(results[0])
    sched.after_plan()
    sched.check_invariants()
    assert _num_findable(sched) == 2
    sched.update(results[1])
    assert _num_findable(sched) == 2  # queued by the result: registered off the path
    sched.after_plan()
    sched.check_invariants()
    assert _num_findable(sched) == 4


def test_a_failed_step_registers_nothing_and_completed_chunks_stay_findable() -> None:
    """The first chunk's step completes (queued, not yet registered), the second chunk's step
    fails: bisection registers what completed steps queued before dropping the table; the
    failed chunk's blocks never become findable, and a request sharing the prompt finds the
    first chunk's blocks only."""
    sched, worker = _setup(async_scheduling=False)
    run = Run()
    plan = sched.schedule()
    assert plan is not None
    run.add(sched.update(worker.execute(plan)))  # no after_plan(): the 2 blocks stay queued
    assert _num_findable(sched) == 0
    failed = sched.schedule()
    assert failed is not None
    worker.held.fail()  # the worker failed the step: its batch needs a reset
    run.add(sched.bisect_failed_step(ErrorCode.WORKER_FAILED, "boom"))
    assert run.final("a").error_code == ErrorCode.WORKER_FAILED  # alone in it: pinned on it
    sched.after_plan()
    sched.check_invariants()
    assert _num_findable(sched) == 2
    assert sched.pool.num_used == 0
    sched.add_request(SubmitRequest("b", PROMPT[:16] + [7], SAMPLING))
    plan = sched.schedule()
    assert plan is not None
    (seq,) = plan.new_seqs
    assert seq.rid == "b" and seq.num_computed_tokens == 8  # a's first chunk, not its second
    sched.check_invariants()
