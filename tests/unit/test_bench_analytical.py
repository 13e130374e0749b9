"""The analytical (queue-limited) model of static vs continuous batching, on worked examples."""

from __future__ import annotations

import pytest

from conveyor.bench.analytical import (
    continuous_steps_packing,
    continuous_steps_queue_limited,
    predict,
    static_steps,
)


def test_static_runs_each_batch_to_its_longest_output() -> None:
    # batches of 2 in arrival order: (10, 100) -> 100, (20, 30) -> 30, (5,) -> 5
    assert static_steps([10, 100, 20, 30, 5], batch_size=2) == 135
    assert static_steps([7], batch_size=4) == 7


def test_continuous_queue_limited_model_and_packing_bound() -> None:
    lens = [10, 100, 20, 30, 5]
    assert continuous_steps_queue_limited(lens, batch_size=2) == pytest.approx(100 * 2.5)
    # N < B: one wave
    assert continuous_steps_queue_limited(lens, batch_size=8) == pytest.approx(100.0)
    assert continuous_steps_packing(lens, batch_size=2) == 100  # the longest one dominates
    assert continuous_steps_packing([10] * 9, batch_size=2) == 45  # ceil(90 / 2)


def test_uniform_lengths_predict_no_gain_and_mixed_lengths_some() -> None:
    uniform = predict([64] * 32, batch_size=16, static_step_s=0.05, continuous_step_s=0.05)
    assert uniform.ratio_queue_limited == pytest.approx(1.0)
    assert uniform.ratio_packing == pytest.approx(1.0)
    mixed = [16, 256] * 16  # every batch of 16 holds a 256: static 2 x 256 steps
    p = predict(mixed, batch_size=16, static_step_s=0.05, continuous_step_s=0.05)
    assert p.static_steps == 512
    assert p.ratio_queue_limited == pytest.approx(1.0)  # 256 x 32/16 steps too
    # packing: 16 slots, 32 x 136 = 4352 tokens -> max(256, ceil(4352 / 16) = 272) = 272 steps
    assert p.continuous_steps_packing == 272
    assert p.ratio_packing == pytest.approx(512 / 272)


def test_step_times_enter_each_side() -> None:
    p = predict([10, 20], batch_size=1, static_step_s=0.2, continuous_step_s=0.1)
    assert p.static_time_s == pytest.approx(30 * 0.2)
    assert p.continuous_time_s_queue_limited == pytest.approx(20 * 2 * 0.1)
    assert p.ratio_queue_limited == pytest.approx(6.0 / 4.0)
    with pytest.raises(ValueError):
        predict([10], batch_size=1, static_step_s=0.0, continuous_step_s=0.1)
    with pytest.raises(ValueError):
        static_steps([], batch_size=2)
