"""The dispatch policy of async scheduling (services/scheduler/dispatch.py): the step-time
estimator and when plan N+1 leaves."""

from __future__ import annotations

import math

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.dispatch import (
    HOLD_MIN_RATIO,
    HOLD_MIN_STEP_S,
    LEAD_FRACTION,
    LEAD_PATHS,
    WINDOW,
    DispatchPolicy,
    StepTimeEstimator,
    size_class,
)


def test_size_classes_are_powers_of_two_per_kind() -> None:
    assert [size_class(n)[0] for n in (0, 1, 2, 3, 4, 7, 8, 255, 256, 511, 512)] == [
        0, 1, 2, 2, 3, 3, 4, 8, 9, 9, 10,
    ]  # fmt: skip
    assert size_class(8, decode_only=True) != size_class(8, decode_only=False)


def test_estimate_is_the_median_of_comparable_recent_steps() -> None:
    est = StepTimeEstimator()
    assert est.predict(8, True) is None  # nothing seen
    for seconds in (0.10, 0.11, 0.12):
        est.observe(8, True, seconds)  # decodes of 8 sequences
    for seconds in (0.60, 0.62):
        est.observe(264, False, seconds)  # a 256-token chunk beside 8 decodes
    est.observe(12, False, 0.3)  # a short prompt beside decodes: prefill costs extra on a CPU
    assert est.predict(9, True) == pytest.approx(0.11)  # same class (8-15): the decodes' median
    assert est.predict(300, False) == pytest.approx(0.61)  # the chunk steps', not a blend
    assert est.predict(9, False) == pytest.approx(0.3)  # same size, the other kind
    assert est.predict(40, True) is None  # a class never seen has no estimate


def test_one_outlier_does_not_move_the_estimate() -> None:
    est = StepTimeEstimator()
    for seconds in (0.10, 0.10, 2.5, 0.10, 0.10):  # a step slowed by another process
        est.observe(16, True, seconds)
    assert est.predict(16, True) == pytest.approx(0.10)


def test_old_steps_roll_out_of_the_window() -> None:
    est = StepTimeEstimator()
    for _ in range(WINDOW):
        est.observe(16, True, 0.1)
    for _ in range(WINDOW // 2 + 1):  # the contexts grew: steps got slower
        est.observe(16, True, 0.2)
    assert est.predict(16, True) == pytest.approx(0.2)


def test_a_negative_time_is_ignored() -> None:
    est = StepTimeEstimator()
    est.observe(4, True, -1.0)
    assert est.predict(4, True) is None
    with pytest.raises(ValueError):
        StepTimeEstimator(window=0)


def _policy(step_s: float, path_s: float, enabled: bool = True) -> DispatchPolicy:
    policy = DispatchPolicy(enabled=enabled)
    for _ in range(3):
        policy.on_result(8, True, step_s)
    policy.on_path(path_s)
    return policy


def test_long_steps_hold_the_next_plan_until_just_before_the_expected_end() -> None:
    policy = _policy(step_s=0.2, path_s=0.001)  # a CPU step: 200 paths long
    send_at = policy.send_at(8, True, started_at=100.0)
    lead = max(LEAD_PATHS * 0.001, LEAD_FRACTION * 0.2)
    assert send_at == pytest.approx(100.0 + 0.2 - lead)
    assert 100.0 + 0.1 < send_at < 100.0 + 0.2  # in the step's second half, before its end


def test_short_steps_send_at_once() -> None:
    # a simulated H200 step (5 ms) next to a 0.3 ms scheduler path: 17 paths, under the ratio
    assert _policy(step_s=0.005, path_s=0.0003).send_at(8, True, started_at=100.0) is None
    # zero-cost worker
    assert _policy(step_s=0.0, path_s=0.0003).send_at(8, True, started_at=100.0) is None
    # a quiet machine's 70 us path: 5 ms is 70 paths, but under what the loop's timer can aim
    assert _policy(step_s=0.005, path_s=0.00007).send_at(8, True, started_at=100.0) is None
    # just at the ratio it holds
    ratio = _policy(step_s=HOLD_MIN_RATIO * 0.001, path_s=0.001)
    assert ratio.send_at(8, True, started_at=0.0) is not None
    at_floor = _policy(step_s=HOLD_MIN_STEP_S, path_s=0.0001)
    assert at_floor.send_at(8, True, started_at=0.0) is not None


def test_a_new_kind_of_step_waits_for_its_result_on_a_slow_worker_only() -> None:
    slow = _policy(step_s=0.2, path_s=0.001)
    assert slow.send_at(64, True, started_at=0.0) == math.inf  # an unseen size
    assert slow.send_at(8, False, started_at=0.0) == math.inf  # an unseen kind
    fast = _policy(step_s=0.005, path_s=0.0003)  # the simulated H200
    assert fast.send_at(64, True, started_at=0.0) is None
    assert fast.estimator.longest() == pytest.approx(0.005)
    assert StepTimeEstimator().longest() is None


def test_no_estimate_or_switched_off_sends_at_once() -> None:
    nothing_seen = DispatchPolicy(enabled=True)
    nothing_seen.on_path(0.001)
    assert nothing_seen.send_at(8, True, started_at=0.0) is None
    assert _policy(step_s=0.2, path_s=0.001, enabled=False).send_at(8, True, started_at=0.0) is None
    no_path = DispatchPolicy(enabled=True)
    no_path.on_result(8, True, 0.2)
    assert no_path.send_at(8, True, started_at=0.0) is None  # the path not measured yet


def test_the_path_is_a_moving_average() -> None:
    policy = DispatchPolicy(enabled=True)
    policy.on_path(0.001)
    for _ in range(50):
        policy.on_path(0.003)
    policy.on_path(-1.0)  # ignored
    assert policy.path_s == pytest.approx(0.003, rel=1e-3)


def test_the_knob_is_a_validated_config_field() -> None:
    assert SchedulerConfig().just_in_time_plans is True
    assert SchedulerConfig(just_in_time_plans=False).just_in_time_plans is False
    with pytest.raises(ValueError, match="just_in_time_plans must be a bool"):
        SchedulerConfig(just_in_time_plans="yes")  # type: ignore[arg-type]
