"""The step-timing harness behind `conveyor sim measure`, driven against the SIMULATED runner:
its plans must pass the runner's step-contract checks, and its timings must feed calibration."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.worker.sim.calibrate import TIMINGS_FORMAT, fit_profile, load_timings
from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.measure import MeasureGrid, collect_timings
from services.worker.sim.profiles import MODELS, DeviceProfile
from services.worker.sim.runner import SimRunner

SMALL = MeasureGrid(
    batch_sizes=(1, 4),
    context_lens=(16, 40),
    prefill_lens=(8, 24),
    prefill_batch=2,
    mixed=((3, 20),),
    mixed_context=30,
    repeats=2,
    rounds=1,
)


def test_grid_shapes_and_contract() -> None:
    runner = SimRunner(SimConfig(device="none", model="smollm2-135m", num_blocks=64))
    samples = collect_timings(runner, SMALL)  # SimRunner raises on any contract breach
    kinds = [s["kind"] for s in samples]
    assert kinds.count("decode") == 2 * 2  # batch sizes x contexts
    assert kinds.count("prefill") == 2 * 2  # lengths x {1, prefill_batch}
    assert kinds.count("mixed") == 1
    decodes = [s for s in samples if s["kind"] == "decode"]
    assert decodes[0]["start_positions"] == [17] and decodes[1]["start_positions"] == [17] * 4
    mixed = [s for s in samples if s["kind"] == "mixed"][0]
    assert mixed["num_tokens"] == [20, 1, 1, 1] and mixed["start_positions"] == [0, 31, 31, 31]
    assert all(len(s["seconds"]) == 2 for s in samples)  # repeats


def test_rounds_gather_every_shape_once_with_all_its_times() -> None:
    runner = SimRunner(SimConfig(device="none", model="smollm2-135m", num_blocks=64))
    grid = dataclasses.replace(SMALL, rounds=3)
    samples = collect_timings(runner, grid)
    assert len(samples) == len(collect_timings(runner, SMALL))
    assert all(len(s["seconds"]) == 2 * 3 for s in samples)  # repeats x rounds


def test_pool_too_small_is_a_clear_error() -> None:
    runner = SimRunner(
        SimConfig(device="none", model="smollm2-135m", num_blocks=4, max_model_len=64)
    )
    with pytest.raises(ValueError, match="exceed the worker's KV pool"):
        collect_timings(runner, SMALL)


# Enough shapes for the cost model's terms to be told apart (decodes at three batch sizes and
# three contexts, prefills at three lengths), three repeats a shape so one step stalled by a busy
# host does not move its median.
CALIBRATION = MeasureGrid(
    batch_sizes=(1, 4, 8),
    context_lens=(16, 40, 80),
    prefill_lens=(8, 24, 64),
    prefill_batch=2,
    mixed=((3, 20), (6, 40)),
    mixed_context=30,
    repeats=3,
    rounds=1,
)
# The fit's promise is the least squared relative error over the samples; timing noise here is
# sleep overshoot (~0.1 ms on steps of 5-50 ms) plus a rare stall, so the fitted profile's step
# times sit within a few % of the device's; 15% at the median leaves room for a busy host and
# still fails a fit that lost a term or a harness that timed the wrong steps.
MEDIAN_FIT_ERROR = 0.15


def test_timings_are_the_steps_and_calibrate(tmp_path) -> None:
    slow = DeviceProfile("slow", 1e12, 1e11, None, 10**9, launch_s=5e-3, per_seq_s=1e-3)
    path = tmp_path / "slow.json"
    path.write_text(slow.to_json())
    runner = SimRunner(SimConfig(profile_path=path, model="smollm2-135m", num_blocks=128))
    samples = collect_timings(runner, CALIBRATION)
    model = MODELS["smollm2-135m"]
    modelled = [
        step_cost(
            slow, step_work(model, s["start_positions"], s["num_tokens"], s["num_sampled"])
        ).total_s
        for s in samples
    ]
    for s, t in zip(samples, modelled, strict=True):  # a timed step lasts its modelled time
        assert min(s["seconds"]) >= t - 1e-4
    timings = tmp_path / "timings.json"
    timings.write_text(
        json.dumps({"format": TIMINGS_FORMAT, "model": model.name, "samples": samples})
    )
    fit = fit_profile(*load_timings(timings), slow, "fit", "test")
    assert len(fit.measured) == len(samples)
    # the fitted profile reproduces the device: its step times against the modelled ones
    errors = sorted(abs(p / t - 1.0) for p, t in zip(fit.predicted, modelled, strict=True))
    assert errors[len(errors) // 2] <= MEDIAN_FIT_ERROR, errors
    # and it is the device's shape, not a flat fit: prompts cost by their tokens
    tokens = [sum(s["num_tokens"]) for s in samples]
    by_tokens = sorted(zip(tokens, fit.predicted, strict=True))
    assert by_tokens[-1][1] > 2 * by_tokens[0][1]
