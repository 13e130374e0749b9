"""What the step-time predictor learns from (services/scheduler/step_costs.py): every step
where a policy reads it (--policy slo, speculation), one step in SAMPLED_EVERY elsewhere (a
step's shape is O(rows)); a drafted step is learned with the drafts the worker computed."""

from __future__ import annotations

import dataclasses

from test_scheduler_support import Run, make, submit

from services.scheduler.step_costs import SAMPLED_EVERY
from shared.step_cost import step_shape


def _shaped_steps(policy: str, num_steps: int) -> list[int]:
    """Step ids whose in-flight record carries a shape, over `num_steps` steps of 4 decodes."""
    sched, worker, _ = make(num_blocks=512, policy=policy, max_num_seqs=4)
    for i in range(4):
        assert sched.add_request(submit(f"r{i}", 8, 10 * num_steps)) is None
    run, shaped = Run(), []
    for _ in range(num_steps):
        plan = sched.schedule()
        flight = sched.in_flight.newest()
        assert plan is not None and flight is not None
        if flight.shape is not None:
            shaped.append(plan.step_id)
        result = worker.execute(plan)
        run.add(sched.update(dataclasses.replace(result, forward_s=0.01)))
        sched.after_plan()
    return shaped


def test_a_policy_that_reads_the_predictor_gets_every_step_others_one_in_16() -> None:
    num_steps = 4 * SAMPLED_EVERY
    assert _shaped_steps("fcfs", num_steps) == list(range(SAMPLED_EVERY, num_steps + 1,
                                                          SAMPLED_EVERY))  # fmt: skip
    assert _shaped_steps("slo", num_steps) == list(range(1, num_steps + 1))


def test_drafts_join_a_step_shape_as_the_tokens_they_are() -> None:
    # three decodes at position 10; the worker proposed 2, 0 and 1 drafts: the same as rows
    # computing 3, 1 and 2 tokens, each sampled
    decodes = step_shape([10, 10, 10], [1, 1, 1], 3)
    assert decodes.with_drafts([2, 0, 1]) == step_shape([10, 10, 10], [3, 1, 2], 6)
    assert decodes.with_drafts([0, 0, 0]) is decodes


def test_a_loop_measure_far_below_forward_s_is_not_the_step_time() -> None:
    # every result is read just after the one before it (0.4 ms apart) while the worker says
    # each step took 20 ms: the predictor learns at least half of forward_s (a pipelined
    # worker's forward_s spans two steps at most), never the 0.4 ms
    sched, worker, _ = make(num_blocks=512, policy="slo", max_num_seqs=4)
    for i in range(4):
        assert sched.add_request(submit(f"r{i}", 8, 1000)) is None
    for _ in range(80):  # past the first fit (64 steps)
        plan = sched.schedule()
        assert plan is not None
        result = dataclasses.replace(worker.execute(plan), forward_s=0.02)
        sched.update(result, step_s=0.0004)
        sched.after_plan()
    predicted = sched.predictor.predict(step_shape([100] * 4, [1] * 4, 4))
    assert predicted is not None and 0.009 < predicted < 0.021
