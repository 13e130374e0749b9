"""Evicting cached blocks ahead (`BlockPool.evict_ahead`, `PrefixCache.after_plan`), ~5 s.

Once the free stack is empty (a full cache), every allocation evicts on the result -> plan path.
`after_plan()` moves a bounded number of the next blocks to evict onto the free stack while the
worker computes. What that may change, and what not:

* allocations take the same blocks in the same order as a pool that never evicts ahead (a twin
  pool driven by the same operations, property test);
* the only difference is what is findable: a lookup can miss only blocks evicted ahead and not
  reused yet, the least recently used ones, never more than the largest target asked for;
* in a scheduler with a full cache and a steady load, schedule() evicts nothing itself, and
  every invariant holds (`check_invariants()` after every call).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_support import CheckingWorker, FakeClock, Run, submit

from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.block_pool import BlockPool
from services.scheduler.prefix_cache import EVICT_AHEAD_STEPS, PrefixCache

# weighted towards what fills a pool with cached blocks and then evicts them
OPS = ["alloc"] * 3 + ["free", "register"] * 2 + ["hit"] + ["ahead"] * 2
ops_lists = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 99)), min_size=20, max_size=100)


class _Twins:
    """Two pools driven by the same operations; only `ahead` evicts ahead in the first."""

    def __init__(self, num_blocks: int) -> None:
        self.ahead = BlockPool(num_blocks, block_size=1)
        self.plain = BlockPool(num_blocks, block_size=1)
        self.num_blocks = num_blocks
        self.tables: list[list[int]] = []
        self.next_key = 1  # every registration a new key: both pools accept or refuse alike
        self.max_target = 0

    def lost(self) -> set[int]:
        """Blocks the plain pool can still find but the other one evicted ahead."""
        return {
            b
            for b in range(self.num_blocks)
            if self.plain.key_of(b) is not None and self.ahead.key_of(b) is None
        }

    def apply(self, op: str, x: int) -> None:
        a, p = self.ahead, self.plain
        if op == "alloc":
            got = a.allocate(1 + x % 3)
            assert got == p.allocate(1 + x % 3)  # the same blocks, in the same order
            if got is not None:
                self.tables.append(got)
        elif op == "free" and self.tables:
            table = self.tables.pop(x % len(self.tables))
            a.free(table)
            p.free(table)
        elif op == "register" and self.tables:  # the table's first blocks (a prefix)
            table = self.tables[x % len(self.tables)]
            keys = list(range(self.next_key, self.next_key + len(table)))
            self.next_key += len(table)
            a.register_blocks(table, keys, 0, 1 + x % len(table))
            p.register_blocks(table, keys, 0, 1 + x % len(table))
        elif op == "hit":
            self._hit(x)
        elif op == "ahead":
            target = x % 7
            self.max_target = max(self.max_target, target)
            plain_free = a.num_plain_free
            cached = a.num_free - plain_free
            moved = a.evict_ahead(target)
            assert moved == max(0, min(target - plain_free, cached))

    def _hit(self, x: int) -> None:
        keys = [k for k in (self.plain.key_of(b) for b in range(self.num_blocks)) if k]
        if not keys:
            return
        key = keys[x % len(keys)]
        found = self.ahead.find_prefix([key], 1)
        expected = self.plain.find_prefix([key], 1)
        if found != expected:  # the documented loss: a block evicted ahead, not reused yet
            assert not found and expected[0] in self.lost()
            return  # not taken in either pool: they stay twins
        self.ahead.take_cached(found)
        self.plain.take_cached(found)
        self.tables.append(found)


@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(1, 10), ops=ops_lists)
def test_evicting_ahead_changes_only_what_is_findable(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    twins = _Twins(num_blocks)
    for op, x in ops:
        twins.apply(op, x)
        a, p = twins.ahead, twins.plain
        a.check_invariants(twins.tables, shared_ok=True)
        p.check_invariants(twins.tables, shared_ok=True)
        assert a.num_free == p.num_free
        lost = twins.lost()
        # lost blocks are unowned and unregistered in the pool that evicted them ahead
        assert all(a.num_reviving([b]) for b in lost)
        assert a.num_cached == p.num_cached - len(lost)
        assert len(lost) <= twins.max_target  # at most the largest target asked for
    for table in twins.tables:
        twins.ahead.free(table)
        twins.plain.free(table)
    twins.ahead.check_invariants([], shared_ok=True)
    assert twins.ahead.num_free == num_blocks


def test_after_plan_evicts_the_next_blocks_to_evict_and_the_root_lives_longest() -> None:
    """A picture: a 3-block prefix cached, every other block taken. after_plan() tops the free
    stack up to what the last step took (capped): the deepest cached blocks go first, the
    prefix's root stays findable, and the next allocation pops exactly those blocks."""
    pool = BlockPool(6, block_size=1)
    cache = PrefixCache(pool, b"m", enabled=True)
    first = pool.allocate(3)
    assert first is not None
    keys = [11, 12, 13]
    pool.register_blocks(first, keys, 0, 3)
    pool.free(first)  # cached, released deepest first
    plain = pool.allocate(3)  # the three plain blocks: the free stack is empty
    assert plain is not None and not set(plain) & set(first)
    cache.after_plan(max_step_blocks=2)  # the step took 6 blocks: capped at 2
    assert pool.num_plain_free == 2 and pool.num_evicted == 2
    assert pool.find_prefix(keys, 3) == first[:1]  # the root is still findable
    again = pool.allocate(2)
    assert again == [first[2], first[1]]  # what allocate() would have evicted
    assert pool.num_evicted == 2  # nothing evicted by the allocation itself
    cache.after_plan(max_step_blocks=2)  # the last steps took 6 and 2: tops up to 2
    assert pool.num_plain_free == 1 and pool.find_prefix(keys, 3) == []
    pool.check_invariants([plain, again])


def test_after_plan_keeps_nothing_evicted_while_free_blocks_suffice() -> None:
    """With free blocks to spare nothing is evicted ahead: every cached block stays findable."""
    pool = BlockPool(64, block_size=1)
    cache = PrefixCache(pool, b"m", enabled=True)
    table = pool.allocate(8)
    assert table is not None
    pool.register_blocks(table, list(range(1, 9)), 0, 8)
    pool.free(table)
    for _ in range(EVICT_AHEAD_STEPS + 2):
        got = pool.allocate(4)
        assert got is not None
        cache.after_plan(max_step_blocks=16)
        pool.free(got)
    assert pool.num_evicted == 0 and pool.find_prefix(list(range(1, 9)), 8) == table


def test_a_full_cache_under_steady_load_evicts_nothing_on_the_path() -> None:
    """Requests of distinct prompts (0% hits) arrive as others finish, so the cache fills with
    their blocks and then every allocation needs an eviction. With after_plan() after each
    plan, schedule() finds its blocks on the free stack: after the first steps it evicts
    nothing itself (it would only in a step that takes more blocks than any of the last
    `EVICT_AHEAD_STEPS`); every invariant holds; and the blocks evicted ahead and not yet reused
    (on the free stack) never exceed one step's worth."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, chunk_size=16)
    num_blocks, bs = 160, 4
    most = -(-24 // bs) + 4  # what one step can allocate (scheduler.py after_plan)
    sched = Scheduler(config, num_blocks, bs, 256, [], clock=FakeClock(), cache_namespace=b"m")
    worker = CheckingWorker(num_blocks, bs)
    run = Run()
    evicted_on_path: list[int] = []
    for i in range(3):
        sched.add_request(submit(f"long{i}", 30, 150))  # decodes crossing block boundaries
    for step in range(140):  # the long requests run throughout: a steady load
        if sched.stats()["num_waiting"] == 0:
            sched.add_request(submit(f"new{step}", 37, 2))  # 9 full blocks, cached when done
        before = sched.pool.num_evicted
        plan = sched.schedule()
        assert plan is not None
        evicted_on_path.append(sched.pool.num_evicted - before)
        sched.check_invariants()
        before = sched.pool.num_evicted
        sched.after_plan()
        sched.check_invariants()
        if sched.pool.num_evicted > before:  # topped up: at most one step's worth
            assert sched.pool.num_plain_free <= most
        run.add(sched.update(worker.execute(plan)))
        sched.check_invariants()
    assert sched.pool.num_evicted > 200  # the cache was full: blocks were reused
    assert sched.stats()["num_preemptions"] == 0
    assert sum(evicted_on_path[EVICT_AHEAD_STEPS:]) == 0
