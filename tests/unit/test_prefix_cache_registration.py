"""When a block filled by a prefill chunk becomes findable (~1 s): the plan counts the chunk's
full blocks when it is built (step.py `BuiltStep.filled`), the step's result queues them, and
`after_plan()` (or a lookup that may need them) registers them. So a block is findable once the
step that filled it has completed: not while it is in flight (overlap: a later plan's chunk is
not counted with an earlier result), never when it failed. And the pool's held state (a
finished table, released by `after_plan()`) releases its blocks in the order `free()` would.
"""

from __future__ import annotations

from test_scheduler_support import CheckingWorker, FakeClock, Run

from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.block_pool import BlockPool
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
    sched.check_integrity()
    assert _num_findable(sched) == 2
    sched.update(results[1])
    assert _num_findable(sched) == 2  # queued by the result: registered off the path
    sched.after_plan()
    sched.check_integrity()
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
    sched.check_integrity()
    assert _num_findable(sched) == 2
    assert sched.pool.num_used == 0
    sched.add_request(SubmitRequest("b", PROMPT[:16] + [7], SAMPLING))
    plan = sched.schedule()
    assert plan is not None
    (seq,) = plan.new_seqs
    assert seq.rid == "b" and seq.num_computed_tokens == 8  # a's first chunk, not its second
    sched.check_integrity()


def test_held_tables_release_in_the_order_free_would() -> None:
    """A pool that frees tables and its twin that holds them (then releases the holds) end in
    the same state: same free count at every point, then the same allocation order, including
    a block a hit took out of one hold and a later hold held again."""
    freed, held = BlockPool(10, block_size=1), BlockPool(10, block_size=1)
    keys = [(i + 1) << 100 for i in range(10)]
    t1, t2 = freed.allocate(4), freed.allocate(3)
    assert t1 is not None and t2 is not None
    assert held.allocate(4) == t1 and held.allocate(3) == t2
    kept = freed.allocate(1)  # a table nobody releases
    assert kept is not None and held.allocate(1) == kept
    for pool in (freed, held):
        pool.register_blocks(t1, keys, 0, 3)  # t1's first 3 blocks are findable
    freed.free(t1)
    held.hold(t1)
    hit = freed.find_prefix(keys, 2)
    assert hit == held.find_prefix(keys, 2) == t1[:2]
    for pool in (freed, held):
        pool.take_cached(hit)  # taken back out of the cache / out of the first hold
        assert pool.num_free == 10 - 1 - 3 - 2
        pool.check_integrity([kept, t2, hit], shared_ok=True)
    freed.free(t2)
    held.hold(t2)
    freed.free(hit)
    held.hold(hit)  # held again, by a later hold than the one it left
    assert held.num_held == 2 + 3 + 2 and freed.num_free == held.num_free == 9
    held.check_integrity([kept], shared_ok=True)
    held.release_held()
    assert held.num_held == 0
    for pool in (freed, held):
        pool.check_integrity([kept], shared_ok=True)
    assert [freed.allocate(1) for _ in range(9)] == [held.allocate(1) for _ in range(9)]
    assert freed.num_evicted == held.num_evicted == 3
