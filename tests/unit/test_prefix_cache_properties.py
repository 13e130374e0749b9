"""Property tests of automatic prefix caching (~10-20 s): the scheduler driven by random streams
of requests that share prefixes, with aborts (also while a step is in flight), preemptions
(small pools), evictions, cache resets and every policy (the pool alone:
tests/unit/test_prefix_cache_pool.py).

After every step: `check_invariants()` holds (each block owned, free or cached; ref counts equal
owners; nothing both cached and owned-free; a table's registered blocks hold the keys its request
claims), and the checking worker read every cached position of every scheduled request back
through its table: a hit on a block holding another prefix's KV fails there. At the end nothing
leaks, every request finished once with the model's tokens, and hits did happen.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_scheduler_support import (
    CheckingWorker,
    FakeClock,
    Run,
    arrive,
    check_composition,
    last_record,
    token_for,
)

from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.block_pool import BlockPool
from services.scheduler.composition import STEP_COMPOSITIONS
from services.scheduler.policy import WaitingQueue
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence, StepPlan

VOCAB = 50


# ---- the scheduler ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    step: int
    family: int  # requests of one family share its prefix
    prefix_len: int
    suffix_len: int
    max_tokens: int
    abort_step: Optional[int]
    abort_in_flight: bool

    def prompt(self, rid: str) -> list[int]:
        prefix = [(self.family * 101 + i * 7) % 97 + 3 for i in range(self.prefix_len)]
        suffix = [(zlib.crc32(rid.encode()) + i) % 97 + 3 for i in range(self.suffix_len)]
        return (prefix + suffix) or [5]

    def request(self, rid: str) -> SubmitRequest:
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        return SubmitRequest(rid, self.prompt(rid), sampling)


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 12),
    family=st.integers(0, 2),
    prefix_len=st.sampled_from([9, 17, 30]) | st.integers(0, 30),
    suffix_len=st.integers(0, 6),
    max_tokens=st.integers(1, 12),
    abort_step=st.none() | st.none() | st.integers(0, 30),
    abort_in_flight=st.booleans(),
)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 5))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 30)),
        chunk_size=draw(st.integers(1, 24)),
        max_wait=draw(st.sampled_from([0.0, 0.05, 10.0])),
        policy=draw(st.sampled_from(["fcfs", "lpm", "short-first", "priority"])),
        batching=draw(st.sampled_from(["continuous", "continuous", "dynamic", "static"])),
        watermark=draw(st.sampled_from([0.0, 0.1])),
        enable_prefix_caching=True,
        step_composition=draw(st.sampled_from(STEP_COMPOSITIONS)),
        max_prefill_chunks=draw(st.integers(1, 3)),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    num_blocks=st.integers(4, 12) | st.integers(13, 40),  # small: preemption and eviction
    block_size=st.sampled_from([1, 2, 4]),
    workload=st.lists(arrivals, min_size=2, max_size=12),
    reset_steps=st.sets(st.integers(0, 40), max_size=2),
    after_plan=st.booleans(),
)
def test_shared_prefix_workloads_keep_every_invariant(
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    workload: list[Arrival],
    reset_steps: set[int],
    after_plan: bool,
) -> None:
    """`after_plan`: whether the registrations queued on the result -> plan path are flushed
    after each plan, as the server does, or only by lookups that may need them."""
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, block_size, 80, [], clock=clock, cache_namespace=b"m")
    worker = CheckingWorker(num_blocks, block_size, vocab_size=VOCAB)
    run = Run()
    admitted: dict[str, Arrival] = {}
    last_arrival = max(a.step for a in workload)
    for step in range(3000):
        admitted.update(arrive(sched, workload, step, False, run))
        if step in reset_steps:
            assert sched.reset_prefix_cache() >= 0
        plan = sched.schedule()
        sched.check_invariants()
        check_composition(sched, plan)
        if plan is not None:
            if after_plan:
                sched.after_plan()
                sched.check_invariants()
            arrive(sched, workload, step, True, run)  # aborts while in flight
            run.add(sched.update(worker.execute(plan)))
            sched.check_invariants()
        elif step > last_arrival and not sched.has_work():
            break
        clock.advance(max(0.01, sched.next_timeout() or 0.0) if plan is None else 0.01)
    assert not sched.has_work(), "work left after 3000 steps"
    assert sched.pool.num_used == 0 and sched.pool.num_free == num_blocks  # no leak
    sched.check_invariants()
    stats = sched.stats()
    event(f"hits: {stats['prefix_cache_hits'] > 0}")
    event(f"evictions: {stats['num_prefix_cache_evictions'] > 0}")
    event(f"preempted: {stats['num_preemptions'] > 0}")
    event(f"composition: {config.step_composition}")
    for rid, a in admitted.items():
        final = run.final(rid)
        tokens = run.tokens(rid)
        assert tokens == [token_for(rid, i, VOCAB) for i in range(len(tokens))]
        if final.finish_reason != "abort":
            assert final.finish_reason == "length"
            cached = final.num_cached_tokens
            assert cached % block_size == 0 and cached < len(a.prompt(rid))


def _family_setup() -> tuple[Scheduler, CheckingWorker, SamplingParams, list[int]]:
    """A small caching scheduler, its checking worker, greedy 3-token sampling, and a 20-token
    prefix (5 full blocks of 4) that requests of one family share."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64)
    sched = Scheduler(config, 32, 4, 128, [], clock=FakeClock(), cache_namespace=b"m")
    worker = CheckingWorker(32, 4, vocab_size=VOCAB)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    return sched, worker, sampling, list(range(10, 30))


def test_hits_happen_and_count_in_the_step_log() -> None:
    """A fixed picture: the second request of a family hits the first one's full blocks and
    computes only the rest; the step record and the counters say so."""
    sched, worker, sampling, prefix = _family_setup()
    sched.add_request(SubmitRequest("a", prefix + [1, 2], sampling))
    run = Run()
    plan = sched.schedule()
    assert plan is not None
    run.add(sched.update(worker.execute(plan)))
    sched.add_request(SubmitRequest("b", prefix + [3, 4, 5], sampling))
    plan = sched.schedule()
    assert plan is not None
    i = worker.peek(plan).rids.index("b")
    assert worker.peek(plan).start_positions[i] == 20 and worker.peek(plan).num_tokens[i] == 3
    rec = last_record(sched)
    assert rec is not None
    assert rec.num_prefix_cache_queries == 23 and rec.num_prefix_cache_hits == 20
    run.add(sched.update(worker.execute(plan)))
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        run.add(sched.update(worker.execute(plan)))
    assert run.final("b").num_cached_tokens == 20 and run.final("a").num_cached_tokens == 0
    stats = sched.stats()
    assert stats["prefix_cache_queries"] == 22 + 23 and stats["prefix_cache_hits"] == 20
    assert sched.reset_prefix_cache() == stats["prefix_cache_blocks"] > 0


def _new_seq(plan: StepPlan, rid: str) -> NewSequence:
    """The sequence `rid` joining the worker's batch in `plan` (its cached prefix is skipped)."""
    return next(seq for seq in plan.new_seqs if seq.rid == rid)


def test_lookups_flush_queued_registrations_only_when_these_may_hit() -> None:
    """Blocks a completed step filled are queued for registration (flushed by `after_plan()`,
    off the result -> plan path). A lookup that no queued block can extend (a prompt nobody
    shares) leaves the queue alone; one that a queued block extends registers it first, so no
    completed block is missed."""
    sched, worker, sampling, prefix = _family_setup()
    sched.add_request(SubmitRequest("a", prefix + [1, 2], sampling))
    run = Run()
    plan = sched.schedule()
    assert plan is not None
    run.add(sched.update(worker.execute(plan)))  # a's 5 full blocks completed: queued
    assert sched.stats()["prefix_cache_blocks"] == 0
    sched.add_request(SubmitRequest("c", list(range(40, 62)), sampling))  # shares nothing
    plan = sched.schedule()
    assert plan is not None and _new_seq(plan, "c").num_computed_tokens == 0
    assert sched.stats()["prefix_cache_blocks"] == 0  # that lookup flushed nothing
    sched.after_plan()
    assert sched.stats()["prefix_cache_blocks"] == 5
    run.add(sched.update(worker.execute(plan)))  # c's 5 full blocks completed: queued
    sched.add_request(SubmitRequest("d", list(range(40, 60)) + [7], sampling))  # c's prefix
    plan = sched.schedule()
    assert plan is not None
    assert _new_seq(plan, "d").num_computed_tokens == 20  # found the queued blocks
    assert sched.stats()["prefix_cache_blocks"] == 10
    sched.check_invariants()


def _step(sched: Scheduler, worker: CheckingWorker, run: Run) -> StepPlan:
    """One schedule() and its result, without after_plan() (the tests call it when they mean
    to); the invariants hold after each."""
    plan = sched.schedule()
    assert plan is not None
    sched.check_invariants()
    run.add(sched.update(worker.execute(plan)))
    sched.check_invariants()
    return plan


def test_a_finished_request_registers_its_blocks_when_it_finishes() -> None:
    """A finishing request's full blocks (its decode-filled last one too) become findable when
    its result is applied, and its blocks are free (cached) at once; a lookup of a prompt nobody
    shares finds nothing, one of its history finds all of it."""
    sched, worker, sampling, prefix = _family_setup()  # max_tokens 3, 5 prompt blocks of 4
    run = Run()
    sched.add_request(SubmitRequest("a", prefix + [1, 2], sampling))
    _step(sched, worker, run)  # the prompt: its 5 full blocks are queued
    sched.after_plan()
    assert sched.stats()["prefix_cache_blocks"] == 5
    _step(sched, worker, run)
    _step(sched, worker, run)  # a finishes: 24 positions computed, 6 full blocks
    assert run.final("a").finish_reason == "length"
    assert sched.pool.num_free == 32 and sched.pool.num_used == 0
    assert sched.stats()["prefix_cache_blocks"] == 6  # its 6th (decode-filled) block too
    sched.add_request(SubmitRequest("c", list(range(40, 62)), sampling))  # shares nothing
    plan = _step(sched, worker, run)
    assert _new_seq(plan, "c").num_computed_tokens == 0
    history = prefix + [1, 2] + run.tokens("a")[:2]  # what a computed: 24 tokens
    sched.add_request(SubmitRequest("b", history + [9], sampling))
    plan = _step(sched, worker, run)
    assert _new_seq(plan, "b").num_computed_tokens == 24
    sched.after_plan()
    sched.check_invariants()


def test_after_plan_registers_decode_filled_blocks() -> None:
    """after_plan() registers what the step's result and plan queued: the blocks a decode
    filled before its table grew (a finished request's were registered when it finished)."""
    sched, worker, sampling, prefix = _family_setup()
    run = Run()
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sched.add_request(SubmitRequest("a", list(range(60, 67)), long))  # 1 full block + 3
    sched.add_request(SubmitRequest("b", prefix + [1, 2], sampling))
    _step(sched, worker, run)
    sched.after_plan()  # a's 1 and b's 5 prompt blocks
    assert sched.stats()["prefix_cache_blocks"] == 6
    for _ in range(2):  # a decodes positions 7, 8: its table (2 blocks) grows for position 8
        _step(sched, worker, run)
    assert run.final("b").finish_reason == "length"
    assert sched.stats()["prefix_cache_blocks"] == 7  # b's 6th, registered as it finished
    sched.after_plan()  # a's 2nd block (positions 4-7, filled by a decode)
    assert sched.stats()["prefix_cache_blocks"] == 8
    sched.check_invariants()
    # a request sharing a's history finds its decode-filled block
    history = list(range(60, 67)) + run.tokens("a")[:2]
    sched.add_request(SubmitRequest("d", history, sampling))
    plan = _step(sched, worker, run)
    assert _new_seq(plan, "d").num_computed_tokens == 8


def _waiting(rid: str, seq_no: int, prompt: list[int]) -> Request:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), len(prompt), sampling, 0, seq_no, 0.0, 64, frozenset())


def test_lpm_remembers_cached_lengths_until_the_cache_changes() -> None:
    """lpm orders by cached prefix length; it remembers each request's length and looks up
    only its continuation after registrations, all of it again after a cached block was
    dropped (evicted)."""
    pool = BlockPool(8, block_size=4)
    cache = PrefixCache(pool, b"m", enabled=True)
    queue = WaitingQueue("lpm", max_wait=10.0, cache=cache)
    shared = list(range(10, 22))  # 3 full blocks
    x = _waiting("x", 1, list(range(50, 63)))
    y = _waiting("y", 2, shared + [1])
    for req in (x, y):
        cache.prepare(req)  # its block keys, as at arrival
        queue.add(req)
    assert list(queue.ordered(0.0)) == [x, y]  # nothing cached: arrival order
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.register_blocks(blocks, y.block_keys, 0, 2)  # y's first two blocks become cached
    pool.free(blocks)
    assert list(queue.ordered(0.0)) == [y, x]
    assert queue.known_cached_lens()["y"][1] == 8
    assert pool.allocate(8) is not None  # takes every block: both cached ones are evicted
    assert list(queue.ordered(0.0)) == [x, y]
    assert queue.known_cached_lens()["y"][1] == 0
    queue.remove(y)
    assert "y" not in queue.known_cached_lens()


def test_caching_off_never_shares_and_counts_nothing() -> None:
    clock = FakeClock()
    config = SchedulerConfig(max_num_seqs=4, enable_prefix_caching=False)
    sched = Scheduler(config, 32, 4, 128, [], clock=clock)
    worker = CheckingWorker(32, 4, vocab_size=VOCAB)
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run = Run()
    for rid in ("a", "b"):
        sched.add_request(SubmitRequest(rid, list(range(10, 30)), sampling))
        first_start = None
        while sched.has_work():
            plan = sched.schedule()
            assert plan is not None
            if first_start is None:
                first_start = worker.peek(plan).start_positions[worker.peek(plan).rids.index(rid)]
            run.add(sched.update(worker.execute(plan)))
            sched.check_invariants()
        assert first_start == 0  # the same prompt again: computed from scratch
    assert run.final("b").num_cached_tokens == 0
    stats = sched.stats()
    assert stats["prefix_cache_queries"] == 0 and stats["prefix_cache_blocks"] == 0
