"""The scheduler's step-time predictor (shared/step_cost.py, issue 33): fitted from a step log
of the simulated worker's cost model it recovers that model, and it does not fit another one
(its own error report says so)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.profiles import DEVICES, MODELS
from shared.step_cost import (
    MIN_SURPRISES,
    StepCostPredictor,
    StepShape,
    _stack,
    fit,
    predict,
    step_shape,
)

MODEL = MODELS["llama-3-8b"]


def _steps(rng: random.Random, n: int) -> list[tuple[list[int], list[int], int]]:
    """Decode-only steps of 1-256 rows and mixed steps with one prompt chunk."""
    out = []
    for _ in range(n):
        rows = rng.randint(1, 256)
        starts = [rng.randint(16, 4000) for _ in range(rows)]
        tokens = [1] * rows
        if rng.random() < 0.4:
            starts.append(rng.choice([0, 512]))
            tokens.append(rng.randint(64, 2048))
        out.append((starts, tokens, rows + (rng.random() < 0.5) * (len(tokens) > rows)))
    return out


def _refit(predictor: StepCostPredictor, max_calls: int = 9) -> int:
    """Call maybe_refit (once per step in the scheduler) until a fit completes: how many calls
    that took (a full fit: one per starting split)."""
    for calls in range(1, max_calls + 1):
        if predictor.maybe_refit():
            return calls
    raise AssertionError(f"no fit completed in {max_calls} calls")


def _fitted(timed: list[tuple[StepShape, float]]) -> StepCostPredictor:
    predictor = StepCostPredictor(window=len(timed), first_fit=len(timed))
    for shape, seconds in timed:
        predictor.observe(shape, seconds)
    _refit(predictor)
    return predictor


def _worst(predictor: StepCostPredictor, timed: list[tuple[StepShape, float]]) -> float:
    errors = []
    for shape, t in timed:
        guess = predictor.predict(shape)
        assert guess is not None
        errors.append(abs(guess - t) / t)
    return sorted(errors)[int(0.9 * len(errors))]


def _log(device: str, seed: int, n: int = 300) -> list[tuple[StepShape, float]]:
    rng = random.Random(seed)
    return [(step_shape(s, t, k), step_cost(DEVICES[device], step_work(MODEL, s, t, k)).total_s)
            for s, t, k in _steps(rng, n)]  # fmt: skip


def test_recovers_the_simulated_h200_from_its_step_log_and_not_another_device() -> None:
    predictor = _fitted(_log("h200", seed=1))
    assert _worst(predictor, _log("h200", seed=2)) < 0.01  # held-out steps: p90 within 1%
    # fitted on the H200 it does not predict the A100 (another cost model of the same form)
    assert _worst(predictor, _log("a100", seed=2)) > 0.2


def test_a_cost_outside_the_model_shows_in_its_error_report() -> None:
    rng = random.Random(3)
    # step time quadratic in the rows: no coefficients of the model give it
    timed = [(step_shape(s, t, k), 1e-3 + 4e-6 * len(t) ** 2) for s, t, k in _steps(rng, 300)]
    predictor = _fitted(timed[:200])
    for shape, seconds in timed[200:]:  # predicted before observed: out-of-sample errors
        predictor.observe(shape, seconds)
    errors = predictor.errors()
    assert errors is not None and errors[1] > 0.2, errors
    assert _worst(predictor, timed[200:]) > 0.2


def test_no_prediction_before_the_first_fit() -> None:
    predictor = StepCostPredictor(first_fit=4)
    shape = step_shape([10], [1], 1)
    assert predictor.predict(shape) is None and predictor.errors() is None
    for _ in range(3):
        predictor.observe(shape, 0.01)
    assert not predictor.maybe_refit()


def test_long_steps_are_refitted_sooner_than_short_ones() -> None:
    # after the first fit: 16 steps of 1 s are far more than 100 fits' time (a refit is
    # due); 16 steps of 1 us are not (the next fit waits for `refit_every` steps)
    timed = _log("h200", seed=4, n=80)
    for seconds, refits in ((1.0, True), (1e-6, False)):
        predictor = StepCostPredictor(first_fit=64)
        for shape, t in timed[:64]:
            predictor.observe(shape, t)
        _refit(predictor)
        assert predictor.num_fits == 1
        for shape, _ in timed[64:80]:
            predictor.observe(shape, seconds)
        if refits:  # due (a full one here: they surprise the fit), one split a call
            _refit(predictor)
        else:
            assert not any(predictor.maybe_refit() for _ in range(9))


def test_steps_that_surprise_the_fit_make_a_full_refit_due() -> None:
    # fitted on decode-only steps, the predictor cannot know a prompt token's cost; the first
    # few prompt-chunk steps it misses by far make a full fit due (every starting split: a fit
    # from the current branches would keep them on the memory side) before the periodic quick
    # fit would catch up, after which it predicts them
    timed = _log("h200", seed=5, n=400)
    decodes = [(s, t) for s, t in timed if not s.has_chunk]
    chunks = [(s, t) for s, t in timed if s.has_chunk]
    predictor = StepCostPredictor(first_fit=64)
    for shape, t in decodes[:64]:
        predictor.observe(shape, t)
    _refit(predictor)
    assert _worst(predictor, chunks[20:60]) > 0.5  # stale for prompt chunks
    first_refit = None
    for i, (shape, t) in enumerate(chunks[:40]):
        predictor.observe(shape, t)
        if predictor.maybe_refit() and first_refit is None:
            first_refit = i + 1
    # MIN_SURPRISES steps at least; more only while they have not paid for the fit's time
    assert first_refit is not None and first_refit >= MIN_SURPRISES
    assert _worst(predictor, chunks[40:80]) < 0.01  # quick fits alone leave it ~0.2


def test_a_full_fit_is_spread_over_calls_one_starting_split_each() -> None:
    # the scheduler calls maybe_refit once per step, between answering its frontends: a full
    # fit (9 starting splits, ~30 ms) done in one call kept a refusal waiting for all of it
    timed = _log("h200", seed=6, n=64)
    predictor = StepCostPredictor(first_fit=64, max_starts=9)
    for shape, t in timed:
        predictor.observe(shape, t)
    for _ in range(8):  # each call one starting split: nothing to predict with yet
        assert not predictor.maybe_refit() and predictor.predict(timed[0][0]) is None
    extra = step_shape([100], [1], 1)
    predictor.observe(extra, 0.01)  # a step observed meanwhile is not in this fit
    assert predictor.maybe_refit() and predictor.num_fits == 1
    # the same model as the fit done at once on the samples it started with
    features = _stack([s for s, _ in timed])
    at_once = predict(features, fit(features, np.array([t for _, t in timed]), 9))
    for (shape, _), expected in zip(timed, at_once, strict=True):
        assert predictor.predict(shape) == pytest.approx(float(expected), rel=1e-9)
