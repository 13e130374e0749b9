"""Property tests over random configs, workloads, worker results and aborts (~10-20 s).

After every step: the scheduler passes `check_invariants()` (and the checking worker saw no
request read another's KV), tokens scheduled <= budget, running <= max_num_seqs, and the plan
has its step composition's shape (prefill-first and decode-first never mix prompt chunks with
decodes in one forward; decode-first runs at most `max_prefill_chunks` chunks in one). At the
end: every admitted request finished exactly once, within its limits, and no block leaked.
Every composition runs under each of these properties (drawn with the rest of the config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_scheduler_support import (
    CheckingWorker,
    FakeClock,
    Run,
    arrive,
    check_composition,
    submit,
    token_for,
)

from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.composition import STEP_COMPOSITIONS
from shared.protocol.engine_channel import SubmitRequest

EOS = 0
VOCAB = 12  # small, so the end-of-sequence token comes up now and then


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    priority: int
    ignore_eos: bool
    abort_step: Optional[int]  # abort before this step's schedule()
    abort_in_flight: bool  # ... or while this step's plan is at the worker

    def request(self, rid: str) -> SubmitRequest:
        return submit(rid, self.prompt_len, self.max_tokens, priority=self.priority,
                      ignore_eos=self.ignore_eos)  # fmt: skip


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 15),
    prompt_len=st.integers(1, 12) | st.integers(13, 40),
    max_tokens=st.integers(1, 16),
    priority=st.integers(0, 3),
    ignore_eos=st.booleans(),
    abort_step=st.none() | st.integers(0, 40),
    abort_in_flight=st.booleans(),
)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 6))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + draw(st.integers(0, 30)),
        chunk_size=draw(st.integers(1, 24)),
        batch_size=draw(st.none() | st.integers(1, max_num_seqs)),
        batch_timeout=draw(st.sampled_from([0.0, 0.02, 0.1])),
        max_wait=draw(st.sampled_from([0.0, 0.05, 10.0])),
        max_waiting=draw(st.integers(1, 30)),
        policy=draw(st.sampled_from(["fcfs", "priority", "short-first"])),
        batching=draw(st.sampled_from(["continuous", "continuous", "dynamic", "static"])),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        step_composition=draw(st.sampled_from(STEP_COMPOSITIONS)),
        max_prefill_chunks=draw(st.integers(1, 3)),
    )


def _check_plan_limits(sched: Scheduler, num_tokens: int) -> None:
    assert num_tokens <= sched.config.max_num_batched_tokens
    sched.check_invariants()


def _check_final(run: Run, rid: str, a: Arrival, max_len: int) -> None:
    """`max_len`: what max_model_len and the whole KV pool allow one request."""
    final = run.final(rid)  # exactly one final output, and it is the last
    tokens = run.tokens(rid)
    # whatever was preempted and recomputed, the outputs are the model's, in order
    assert tokens == [token_for(rid, i, VOCAB) for i in range(len(tokens))]
    assert len(tokens) == final.num_output_tokens <= a.max_tokens
    assert a.prompt_len + len(tokens) <= max_len
    if final.finish_reason == "stop":
        assert tokens[-1] == EOS and not a.ignore_eos
    elif final.finish_reason == "length":
        assert len(tokens) == a.max_tokens or a.prompt_len + len(tokens) == max_len
    else:
        assert final.finish_reason == "abort"
    if not a.ignore_eos:
        assert EOS not in tokens[:-1]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    num_blocks=st.integers(3, 10) | st.integers(11, 40),  # small: preemption
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_model_len=st.integers(4, 80),
    workload=st.lists(arrivals, min_size=1, max_size=14),
)
# Once a livelock: in-place recompute (static batching) with two prefills taking each other's
# only free block every step while an earlier request waited forever.
@example(
    config=SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=4,
        chunk_size=1,
        batch_timeout=0.02,
        max_wait=0.05,
        max_waiting=4,
        policy="short-first",
        batching="static",
        watermark=0.0,
    ),
    num_blocks=5,
    block_size=1,
    max_model_len=52,
    workload=[
        Arrival(0, 11, 1, 0, True, None, True),
        Arrival(0, 5, 9, 0, True, None, False),
        Arrival(0, 1, 3, 0, False, None, True),
        Arrival(13, 1, 2, 0, True, None, True),
        Arrival(0, 2, 12, 0, True, None, True),
        Arrival(0, 1, 8, 0, True, None, True),
        Arrival(11, 1, 6, 0, True, None, False),
        Arrival(11, 1, 15, 0, False, None, False),
        Arrival(14, 1, 14, 0, True, None, False),
    ],
)
def test_random_workloads_keep_every_invariant(
    config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    workload: list[Arrival],
) -> None:
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, block_size, max_model_len, [EOS], clock=clock)
    worker = CheckingWorker(num_blocks, block_size, vocab_size=VOCAB)
    run = Run()
    admitted: dict[str, Arrival] = {}
    last_arrival = max(a.step for a in workload)
    for step in range(3000):
        admitted.update(arrive(sched, workload, step, False, run))
        plan = sched.schedule()
        _check_plan_limits(sched, 0 if plan is None else plan.num_scheduled_tokens)
        check_composition(sched, plan)
        if plan is not None:
            arrive(sched, workload, step, True, run)  # aborts while in flight
            run.add(sched.update(worker.execute(plan)))
            _check_plan_limits(sched, 0)
        elif step > last_arrival and not sched.has_work():
            break
        clock.advance(max(0.01, sched.next_timeout() or 0.0) if plan is None else 0.01)
    assert not sched.has_work(), "work left after 3000 steps"
    assert sched.pool.num_used == 0 and sched.pool.num_free == num_blocks  # no leak
    sched.check_invariants()
    assert set(run.outputs) <= set(admitted)
    event(f"preempted: {sched.stats()['num_preemptions'] > 0}")
    event(f"composition: {config.step_composition}")
    for rid, a in admitted.items():
        event(f"{config.batching} finish: {run.final(rid).finish_reason}")
        _check_final(run, rid, a, min(max_model_len, num_blocks * block_size + 1))
