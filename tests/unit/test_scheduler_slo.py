"""`--policy slo` on the scheduler core with the injected clock (issue 33): the refusal of an
unreachable target is decided on arrival, running requests' TPOT targets cap the steps, and
aging still bounds every wait (check_invariants after every step)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_support import CheckingWorker, FakeClock, Run, make, submit

from services.scheduler import Scheduler
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.step_cost import step_shape


def step_cost_s(rows: int, tokens: int) -> float:
    """The 'device': 2 ms a step, 0.5 ms a row, 20 us a token."""
    return 0.002 + 5e-4 * rows + 2e-5 * tokens


def timed_step(sched: Scheduler, worker: CheckingWorker, clock: FakeClock, run: Run) -> float:
    """One schedule -> worker -> update, the clock advanced by the modelled step time, which the
    result reports as its forward_s (the predictor's input). 0.0 when nothing ran."""
    plan = sched.schedule()
    sched.check_invariants()
    if plan is None:
        clock.advance(0.002)
        return 0.0
    result = worker.execute(plan)
    step = worker.steps[-1]
    shape = step_shape(list(step.start_positions), list(step.num_tokens), sum(step.sample))
    seconds = step_cost_s(shape.num_rows, shape.num_tokens)
    clock.advance(seconds)
    run.add(sched.update(dataclasses.replace(result, forward_s=seconds)))
    sched.after_plan()  # as the server loop does: the predictor refits here
    sched.check_invariants()
    return seconds


def slo_submit(rid: str, prompt_len: int, max_tokens: int, **targets: Any) -> SubmitRequest:
    return dataclasses.replace(submit(rid, prompt_len, max_tokens), **targets)


def test_unreachable_targets_are_refused_on_arrival_and_tpot_caps_the_steps() -> None:
    sched, worker, clock = make(
        num_blocks=512, policy="slo", max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64
    )
    run = Run()
    n = 0
    for i in range(400):  # saturate: the predictor fits and the admission rate is measured
        if i % 2 == 0:
            n += 1
            rejected = sched.add_request(slo_submit(f"w{n}", 24, 12, tpot_ms=12.0, ttft_ms=1e6))
            assert rejected is None
        seconds = timed_step(sched, worker, clock, run)
        if sched.predictor.num_fits:  # after the first fit the 12 ms TPOT caps every step
            assert seconds <= 0.012 + 1e-9, seconds
    assert sched.predictor.num_fits and sched.slo is not None
    assert sched.slo.admission_rate() is not None and sched.stats()["num_waiting"] > 4
    at = clock.now
    refused = sched.add_request(slo_submit("tight", 24, 4, ttft_ms=5.0, on_slo_miss="reject"))
    assert refused is not None and refused.code == ErrorCode.SLO_UNATTAINABLE, refused
    assert clock.now == at and not sched.is_live("tight")  # decided on arrival, no wait
    # a lone decode step is predicted at 2.5 ms+: a 1 ms TPOT cannot be met either
    refused = sched.add_request(slo_submit("tpot", 8, 4, tpot_ms=1.0, on_slo_miss="reject"))
    assert refused is not None and refused.code == ErrorCode.SLO_UNATTAINABLE
    # best-effort instead: queued, behind the reachable ones; a resumed request is never refused
    assert sched.add_request(slo_submit("late", 24, 4, ttft_ms=5.0)) is None
    resumed = slo_submit("again", 24, 4, ttft_ms=5.0, on_slo_miss="reject", attempt=1)
    assert sched.add_request(resumed) is None
    assert sched.add_request(slo_submit("easy", 24, 4, ttft_ms=1e6, on_slo_miss="reject")) is None
    order = [r.rid for r in sched._waiting.ordered(clock.now)]  # noqa: SLF001 - read-only
    assert order.index("easy") < order.index("late") and order[-1] in ("late", "again")
    assert sched.stats()["num_slo_refused"] == 2
    unknown = sched.add_request(slo_submit("x", 4, 4, slo_class="nope"))
    assert unknown is not None and unknown.code == ErrorCode.INVALID_PARAMS


WARM_UP_REQUESTS = 40  # 8 tokens each: >= 8 steps in a batch of <= 4, >= 80 steps in all;
# the predictor fits after 64


def max_step_s(max_num_seqs: int, budget: int) -> float:
    return step_cost_s(max_num_seqs, budget)


@settings(max_examples=15, deadline=None)
@given(
    max_num_seqs=st.integers(1, 4),
    max_wait=st.sampled_from([0.05, 0.2, 0.5]),
    stream_tokens=st.integers(2, 12),
    arrivals_per_step=st.integers(1, 3),
    tpot_ms=st.sampled_from([None, 3.0, 5.0, 50.0]),
    stream_tpot_ms=st.sampled_from([None, 50.0]),
)
def test_under_slo_every_waiting_request_runs_within_the_aging_bound(
    max_num_seqs: int,
    max_wait: float,
    stream_tokens: int,
    arrivals_per_step: int,
    tpot_ms: Optional[float],
    stream_tpot_ms: Optional[float],
) -> None:
    budget = 64
    sched, worker, clock = make(
        num_blocks=512, policy="slo", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        chunk_size=budget, max_wait=max_wait,
    )  # fmt: skip
    run = Run()
    for i in range(WARM_UP_REQUESTS):  # a warm-up the predictor fits on, run to the end
        sched.add_request(slo_submit(f"w{i}", 3, 8, tpot_ms=stream_tpot_ms))
    while sched.has_work():
        timed_step(sched, worker, clock, run)
    # "starved": its target is out of reach (best-effort: last in line), its prompt the longest;
    # a tight TPOT of its own would keep it out of any non-empty batch but for aging
    starved = slo_submit("starved", 40, 4, ttft_ms=0.001, tpot_ms=tpot_ms)
    assert sched.add_request(starved) is None
    arrived, started, num_added = clock.now, None, 0
    for _ in range(3000):
        if started is None and run.outputs.get("starved"):
            started = clock.now
        if started is not None and not sched.has_work():
            break
        if started is None:  # a stream of tighter, shorter requests until it starts
            for _ in range(arrivals_per_step):
                num_added += 1
                req = slo_submit(f"s{num_added}", 3, stream_tokens, ttft_ms=50.0,
                                 tpot_ms=stream_tpot_ms)  # fmt: skip
                sched.add_request(req)
        timed_step(sched, worker, clock, run)
    assert sched.predictor.num_fits
    assert started is not None, "the starved request never ran"
    # Once aged it is first in line and skips the TPOT check; a slot frees at least every
    # `stream_tokens` + 3 steps, and its prompt takes at least one token a step.
    bound = max_wait + (stream_tokens + 3 + 40) * max_step_s(max_num_seqs, budget)
    assert started - arrived <= bound + 1e-9, (started - arrived, bound)
    assert run.final("starved").error_code is None


def test_prompt_tokens_found_cached_count_as_served_in_the_ttft_rate() -> None:
    """With prefix caching, whole prompts wait (`predicted_ttft` sums them), so the measured
    prompt-token rate counts the cached part of an admitted prompt as served: the rate is the
    admission rate times the prompt length, not times its uncached tail (which predicted a
    TTFT several times too long and refused reachable requests)."""
    sched, worker, clock = make(num_blocks=512, policy="slo", max_num_seqs=2,
                                max_num_batched_tokens=64, chunk_size=64,
                                enable_prefix_caching=True)  # fmt: skip
    run, prefix, prompt_len = Run(), list(range(3, 51)), 56  # 48 shared tokens: 12 blocks
    for i in range(240):
        if i % 2 == 0:  # arrivals outpace the 2 slots: a backlog throughout
            tail = [100 + (i + j) % 800 for j in range(prompt_len - len(prefix))]
            sub = submit(f"r{i}", prompt_len, 6)
            assert (
                sched.add_request(dataclasses.replace(sub, prompt_token_ids=prefix + tail)) is None
            )
        timed_step(sched, worker, clock, run)
    assert sched.slo is not None and sched.stats()["num_waiting"] > 4
    requests_per_s, tokens_per_s = sched.slo.admission_rate(), sched.slo.prompt_token_rate()
    assert requests_per_s and tokens_per_s
    assert tokens_per_s / requests_per_s > 0.8 * prompt_len  # the uncached tail: 8 tokens
