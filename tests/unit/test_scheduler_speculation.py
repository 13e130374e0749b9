"""Speculative decoding, the scheduler's side (services/scheduler/speculation.py; design:
docs/design/speculation.md), against the checking worker drafting with random acceptance.

The property test drives random configs, shared-prefix workloads (prefix-cache hits), small pools
(preemption with drafts in flight), aborts, end-of-sequence tokens and results delivered one
plan late at random (async scheduling: plans built while the accepted count is unknown). After
every call `check_invariants()` holds (each table covers the computed tokens and the drafts in
flight; pool and cache bookkeeping) and the checking worker reads every context back through
its table: a rejected draft's KV read as a token's (a block given back too early, or a cache hit
on a block holding one) fails there. At the end: no leaked block, every request finished once
with exactly the model's tokens. ~15 s.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_scheduler_support import (
    CheckingWorker,
    Drafter,
    FakeClock,
    Run,
    arrive,
    random_drafter,
    token_for,
)

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.plan_writer import PlanWriter
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import PlanDrafts, StepPlan, StepResult

EOS = 0
VOCAB = 12  # small: end-of-sequence tokens come up now and then


@dataclass(frozen=True)
class Arrival:
    step: int
    family: int  # requests of one family share a prefix
    prefix_len: int
    suffix_len: int
    max_tokens: int
    ignore_eos: bool
    abort_step: Optional[int]
    abort_in_flight: bool

    def prompt(self, rid: str) -> list[int]:
        prefix = [(self.family * 31 + i * 7) % 97 + 3 for i in range(self.prefix_len)]
        return prefix + [(zlib.crc32(rid.encode()) + i) % 97 + 3 for i in range(self.suffix_len)]

    def request(self, rid: str) -> SubmitRequest:
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                  ignore_eos=self.ignore_eos)  # fmt: skip
        return SubmitRequest(rid, self.prompt(rid), sampling)


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 12),
    family=st.integers(0, 2),
    prefix_len=st.integers(0, 24),
    suffix_len=st.integers(1, 6),
    max_tokens=st.integers(1, 20),
    ignore_eos=st.booleans(),
    abort_step=st.none() | st.none() | st.integers(0, 40),
    abort_in_flight=st.booleans(),
)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 5))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 24)),
        chunk_size=draw(st.integers(1, 24)),
        policy=draw(st.sampled_from(["fcfs", "priority", "short-first", "lpm"])),
        batching=draw(st.sampled_from(["continuous", "continuous", "dynamic", "static"])),
        watermark=draw(st.sampled_from([0.0, 0.1])),
        batch_timeout=0.0,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        num_speculative_tokens=draw(st.integers(1, 6)),
    )


def _drive(
    sched: Scheduler, worker: CheckingWorker, workload: list[Arrival], phases: list[bool]
) -> tuple[Run, dict[str, Arrival]]:
    """Rounds of arrivals, plans (a second in flight when the phase says "ahead"), one result;
    invariants after every call, the after-plan work as the server does it."""
    run, admitted = Run(), {}
    results: deque[StepResult] = deque()
    clock = sched._clock
    assert isinstance(clock, FakeClock)
    last_arrival = max(a.step for a in workload)
    for step in range(3000):
        admitted.update(arrive(sched, workload, step, False, run))
        ahead = phases[step % len(phases)]
        while sched.can_schedule() and (ahead or not results):
            plan = sched.schedule()
            sched.check_invariants()
            if plan is None:
                break
            limits = plan.drafts.limits if plan.drafts else []
            assert plan.num_scheduled_tokens + sum(limits) <= sched.config.max_num_batched_tokens
            results.append(worker.execute(plan))
            sched.after_plan()
            sched.check_invariants()
            arrive(sched, workload, step, True, run)
        if results:
            run.add(sched.update(results.popleft()))
            sched.check_invariants()
        elif step > last_arrival and not sched.has_work():
            break
        clock.advance(max(0.01, sched.next_timeout() or 0.0))
    assert not results and not sched.has_work(), "work left after 3000 rounds"
    return run, admitted


def _check_final(run: Run, rid: str, a: Arrival, max_len: int) -> None:
    final = run.final(rid)  # exactly one final output, and it is the last
    tokens = run.tokens(rid)
    assert tokens == [token_for(rid, i, VOCAB) for i in range(len(tokens))]
    assert len(tokens) == final.num_output_tokens <= a.max_tokens
    assert len(a.prompt(rid)) + len(tokens) <= max_len
    if final.finish_reason == "stop":
        assert tokens[-1] == EOS and not a.ignore_eos
    elif final.finish_reason == "length":
        assert len(tokens) == a.max_tokens or len(a.prompt(rid)) + len(tokens) == max_len
    else:
        assert final.finish_reason == "abort"
    if not a.ignore_eos:
        assert EOS not in tokens[:-1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    num_blocks=st.integers(4, 12) | st.integers(13, 60),  # small: preemption
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_model_len=st.integers(8, 80),
    workload=st.lists(arrivals, min_size=1, max_size=10),
    phases=st.lists(st.booleans(), min_size=1, max_size=6),
    p_right=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    seed=st.integers(0, 1000),
)
def test_random_acceptance_keeps_every_invariant(
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    workload: list[Arrival],
    phases: list[bool],
    p_right: float,
    seed: int,
) -> None:
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, block_size, max_model_len, [EOS], clock=clock,
                      cache_namespace=b"m", speculative=True)  # fmt: skip
    worker = CheckingWorker(num_blocks, block_size, VOCAB, max_model_len,
                            drafter=random_drafter(p_right, seed, VOCAB))  # fmt: skip
    run, admitted = _drive(sched, worker, workload, phases)
    assert sched.pool.num_used == 0 and sched.pool.num_free == num_blocks  # no leak
    max_len = min(max_model_len, num_blocks * block_size + 1)
    for rid, a in admitted.items():
        _check_final(run, rid, a, max_len)
    stats = sched.stats()
    assert stats["spec_decode_num_draft_tokens"] == worker.num_proposed
    assert stats["spec_decode_num_accepted_tokens"] == worker.num_accepted
    event(f"accepted: {worker.num_accepted > 0}")
    event(f"rejected: {worker.num_proposed > worker.num_accepted}")
    event(f"hits: {stats['prefix_cache_hits'] > 0}")
    event(f"preempted: {stats['num_preemptions'] > 0}")


def _one_request(
    drafter: Drafter, **config: object
) -> tuple[Scheduler, CheckingWorker, Run, list[StepPlan]]:
    """A caching scheduler with speculation and its drafting worker; request "a" (6 prompt
    tokens, 12 outputs) driven to its end one plan at a time. Returns the plans too."""
    sched_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunk_size=32,
                                   **config)  # type: ignore[arg-type]  # fmt: skip
    sched = Scheduler(sched_config, 32, 4, 128, [], clock=FakeClock(), cache_namespace=b"m",
                      speculative=True)  # fmt: skip
    worker = CheckingWorker(32, 4, VOCAB, drafter=drafter)
    run, plans = Run(), []
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sched.add_request(SubmitRequest("a", list(range(20, 26)), sampling))
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        plans.append(plan)
        sched.check_invariants()
        run.add(sched.update(worker.execute(plan)))
        sched.check_invariants()
        sched.after_plan()
    return sched, worker, run, plans


def _right_then_wrong(num_right: int) -> Drafter:
    """Always the full limit: the first `num_right` drafts right, the rest wrong."""

    def draft(rid: str, index: int, limit: int) -> list[int]:
        right = [token_for(rid, index + j, VOCAB) for j in range(limit)]
        return [t if j < num_right else (t + 1) % VOCAB for j, t in enumerate(right)]

    return draft


def test_accepted_drafts_come_several_per_step_and_rejected_blocks_go_back() -> None:
    """Drafts of 4, the first 2 right: each step emits 3 tokens; the blocks reserved for the
    rejected drafts are given back (the worker's table trimmed), the counters say so, and
    the request's timings carry its own counts."""
    sched, worker, run, plans = _one_request(_right_then_wrong(2), async_scheduling=False)
    assert run.tokens("a") == [token_for("a", i, VOCAB) for i in range(12)]
    multi = [o for o in run.outputs["a"] if len(o.new_token_ids) == 3]
    assert len(multi) >= 3  # three tokens a step while 4 drafts fit
    assert any(step.draft_limits for step in worker.steps)
    assert any(p.drafts and p.drafts.trim_slots for p in plans), "rejected drafts' blocks go back"
    stats = sched.stats()
    assert stats["spec_decode_num_accepted_tokens"] == worker.num_accepted > 0
    assert stats["spec_decode_num_draft_tokens"] == worker.num_proposed > worker.num_accepted
    assert stats["spec_decode_num_accepted_tokens_pos_1"] > 0
    assert "spec_decode_num_accepted_tokens_pos_2" not in stats
    timings = run.final("a").timings
    assert timings is not None and timings.num_accepted_tokens == worker.num_accepted
    assert sched.pool.num_used == 0


def test_a_rejected_draft_is_never_served_from_the_prefix_cache() -> None:
    """Every draft wrong: a's blocks held rejected drafts' KV at some point. Its history, asked
    again with one more token, hits exactly the blocks its confirmed tokens filled, and the
    checking worker reads each hit position back (a rejected draft's KV there would fail)."""
    sched, worker, run, _ = _one_request(_right_then_wrong(0), async_scheduling=True)
    assert worker.num_proposed > 0 and worker.num_accepted == 0
    history = list(range(20, 26)) + run.tokens("a")[:-1]  # what a computed: 17 tokens
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    sched.add_request(SubmitRequest("b", history + [7], sampling))
    plan = sched.schedule()
    assert plan is not None
    (new,) = plan.new_seqs
    assert new.num_computed_tokens == 16  # its 4 full blocks, found cached
    run.add(sched.update(worker.execute(plan)))  # reads positions 0..15 back: right KV
    sched.check_invariants()


def test_the_checking_worker_catches_a_rejected_draft_read_back() -> None:
    """The check the tests above rely on: a sequence that claims positions whose KV a
    rejected draft wrote fails when its context is read."""
    worker = CheckingWorker(4, 4, VOCAB, drafter=_right_then_wrong(0))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    writer = PlanWriter()
    plan = writer.plan({"a": 3}, [writer.new_sequence("a", [1, 2, 3], 3, [0, 1], sp)])
    worker.execute(plan)  # a's prompt, sampling output 0
    a_slot = plan.new_seqs[0].slot
    drafted = StepPlan(plan.step_id + 1, plan.step_id, 1, 1, drafts=PlanDrafts([a_slot], [3]))
    result = worker.execute(drafted)  # positions 3..6: the decode and 3 wrong drafts
    assert result.drafts is not None and result.drafts.accepted == [0]
    out0, out1 = token_for("a", 0, VOCAB), token_for("a", 1, VOCAB)  # position 4 holds a
    claim = writer.new_sequence("b", [1, 2, 3, out0, out1, 5], 3, [0, 1], sp, 5)  # draft's KV
    with pytest.raises(AssertionError, match="KV holds"):
        worker.execute(StepPlan(drafted.step_id + 1, drafted.step_id, 2, 1, [claim],
                                count_slots=[a_slot], counts=[0]))  # fmt: skip


def test_prompts_take_the_budget_before_drafts() -> None:
    """A drafting decode and a prompt arriving in one step of 8 tokens: the prompt's chunk
    gets the 7 tokens the decode leaves (drafts never delay a prefill), the drafts only what
    is left after it; once the prompt is in, the decodes draft again."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, chunk_size=32,
                             num_speculative_tokens=4)  # fmt: skip
    sched = Scheduler(config, 64, 4, 128, [], clock=FakeClock(), speculative=True)
    worker = CheckingWorker(64, 4, VOCAB, drafter=_right_then_wrong(1))
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sched.add_request(SubmitRequest("a", [20, 21, 22], sampling))
    run = Run()
    for _ in range(3):  # a's prompt, then it decodes with drafts
        plan = sched.schedule()
        assert plan is not None
        run.add(sched.update(worker.execute(plan)))
        sched.after_plan()
    assert plan.drafts is not None and plan.drafts.limits == [4]
    sched.add_request(SubmitRequest("b", list(range(30, 50)), sampling))  # 20 prompt tokens
    limits_seen, chunks = [], []
    while sched.has_work() and len(chunks) < 4:
        plan = sched.schedule()
        assert plan is not None
        step = worker.peek(plan)
        b_tokens = sum(n for rid, n in zip(step.rids, step.num_tokens, strict=True)
                       if rid == "b")  # fmt: skip
        limits = sum(plan.drafts.limits) if plan.drafts else 0
        assert plan.num_scheduled_tokens + limits <= 8
        if b_tokens:
            chunks.append(b_tokens)
        limits_seen.append(limits)
        run.add(sched.update(worker.execute(plan)))
        sched.check_invariants()
        sched.after_plan()
    assert chunks[:3] == [7, 7, 6]  # 20 prompt tokens beside a's one decode: no step lost
    assert limits_seen[:4] == [0, 0, 1, 6]  # the one token left, then all 6 the decodes leave
