"""Aging (issue 14): under `priority` and `short-first`, a request that has waited `max_wait`
ranks before every un-aged one, also when the scheduler makes room for a better priority, so a
steady stream of better-ranked requests cannot starve it: it starts within a bounded time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_support import Run, drive, make, submit

STEP_S = 0.01


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["priority", "short-first"]),
    max_num_seqs=st.integers(1, 4),
    max_wait=st.sampled_from([0.05, 0.2, 0.5]),
    stream_tokens=st.integers(2, 12),
    arrivals_per_step=st.integers(1, 3),
)
def test_a_starved_request_starts_within_max_wait_plus_one_request(
    policy: str, max_num_seqs: int, max_wait: float, stream_tokens: int, arrivals_per_step: int
) -> None:
    sched, worker, clock = make(
        policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_wait=max_wait
    )
    # "starved": the worst priority and the longest prompt; everyone after it ranks better
    assert sched.add_request(submit("starved", 40, 4, priority=100)) is None
    run = Run()
    arrived = clock.now
    started: list[float] = []
    num_added = [0]

    def before_step(i: int) -> None:
        if not started and run.outputs.get("starved"):
            started.append(clock.now)
        if not started and i < 400:  # better-ranked, shorter requests until it starts
            for _ in range(arrivals_per_step):
                num_added[0] += 1
                sched.add_request(submit(f"s{num_added[0]}", 3, stream_tokens, priority=0))

    drive(sched, worker, clock, step_time=STEP_S, before_step=before_step, run=run)
    assert started, "the starved request never ran"
    # Once aged it is first in line; a slot frees at least every `stream_tokens` + 1 steps (one
    # request's whole life), or at once under priority (it takes an un-aged request's slot).
    bound = max_wait + (stream_tokens + 3) * STEP_S
    assert started[0] - arrived <= bound + 1e-9, (started[0] - arrived, bound)
    assert run.final("starved").error_code is None
