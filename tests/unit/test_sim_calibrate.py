"""Calibration recovers known coefficients from synthetic timings (both branches of the max).

The decisions "this term is absent" must not depend on the last bits of a least-squares solve,
which differ between CPUs and BLAS kernels: every exact-recovery test also runs with relative
noise of 1e-12 injected into the timings and with numpy's solver perturbed in its last bits
(`robustness`, below).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import numpy as np
import pytest

from conveyor.sim_cli import main
from services.worker.sim.calibrate import (
    TERM_SHARE_FLOOR,
    TIMINGS_FORMAT,
    fit_profile,
    load_timings,
)
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.profiles import MODELS, DeviceProfile, load_device

MODEL = MODELS["smollm2-135m"]
# Small decodes are memory-bound (269 MB of weights at 50 GB/s = 5.4 ms), large prefills
# compute-bound (512 tokens * 212 MFLOP at 1 TFLOP/s = 109 ms): both branches get samples.
TRUE = DeviceProfile(
    "truth", dense_flops=1e12, attention_flops=2e11, bandwidth=5e10, memory_bytes=10**9,
    launch_s=5e-3, per_seq_s=2e-4, kv_bandwidth=5e10,
)  # fmt: skip
# A CPU-like truth: KV copied at its own (slower) rate, a packing pass over the weights when
# more than one token is computed, a fixed extra cost for steps holding a prompt chunk.
TRUE_CPU = DeviceProfile(
    "truth-cpu", dense_flops=8e10, attention_flops=5e10, bandwidth=6e9, memory_bytes=10**9,
    launch_s=2e-2, per_seq_s=4e-3, kv_bandwidth=1.5e9, pack_bandwidth=3e9, prefill_step_s=3e-2,
)  # fmt: skip


def _shapes() -> list[tuple[list[int], list[int], int]]:
    shapes = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (16, 256, 1024):
            shapes.append(([ctx] * batch, [1] * batch, batch))  # decodes
    for prompt in (16, 64, 128, 256, 512):
        for batch in (1, 4):
            shapes.append(([0] * batch, [prompt] * batch, batch))  # prefills
    shapes.append(([0, 300, 300], [200, 1, 1], 3))  # a mixed step
    return shapes


def _write(tmp_path, noise: float, seed: int = 0, truth: DeviceProfile = TRUE):
    rng = random.Random(seed)
    samples = []
    for starts, tokens, sampled in _shapes():
        t = step_cost(truth, step_work(MODEL, starts, tokens, sampled)).total_s
        reps = [t * (1 + rng.uniform(-noise, noise)) for _ in range(3)]
        samples.append(
            {"start_positions": starts, "num_tokens": tokens, "num_sampled": sampled,
             "seconds": reps}
        )  # fmt: skip
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"format": TIMINGS_FORMAT, "model": MODEL.name, "samples": samples}))
    return path


@pytest.fixture(params=["exact", "noise-1e-12", "solver-last-bits"])
def robustness(request, monkeypatch) -> Iterator[float]:
    """Yields the relative noise to inject into timings; "solver-last-bits" also perturbs every
    least-squares solution by a few ulps, plus ~1e-15 of its largest entry on every entry (a
    coefficient that is exactly 0 on one machine came back as 1e-26 on another)."""
    if request.param == "solver-last-bits":
        real = np.linalg.lstsq
        rng = np.random.default_rng(7)

        def lstsq(a, b, rcond=None):
            sol, *rest = real(a, b, rcond=rcond)
            ulps = 1 + rng.integers(-4, 5, sol.shape) * np.finfo(float).eps
            floor = rng.uniform(-1, 1, sol.shape) * 1e-15 * np.abs(sol).max()
            return (sol * ulps + floor, *rest)

        monkeypatch.setattr(np.linalg, "lstsq", lstsq)
    yield 1e-12 if request.param == "noise-1e-12" else 0.0


def test_both_branches_are_exercised() -> None:
    bounds = {step_cost(TRUE, step_work(MODEL, *s)).bound for s in _shapes()}
    assert bounds == {"compute", "memory"}


def test_recovers_exact_coefficients(tmp_path, robustness: float) -> None:
    model, timings = load_timings(_write(tmp_path, noise=robustness))
    fit = fit_profile(model, timings, TRUE, "fit", "test").profile
    assert fit.dense_flops == pytest.approx(1e12, rel=1e-6)
    assert fit.attention_flops == pytest.approx(2e11, rel=1e-6)
    assert fit.bandwidth == pytest.approx(5e10, rel=1e-6)
    assert fit.kv_bandwidth == pytest.approx(5e10, rel=1e-6)
    assert fit.pack_bandwidth is None and fit.prefill_step_s == 0.0  # a GPU-like truth
    assert fit.launch_s == pytest.approx(5e-3, rel=1e-6)
    assert fit.per_seq_s == pytest.approx(2e-4, rel=1e-6)


def test_recovers_the_cpu_terms(tmp_path, robustness: float) -> None:
    assert {step_cost(TRUE_CPU, step_work(MODEL, *s)).bound for s in _shapes()} == {
        "compute",
        "memory",
    }
    model, timings = load_timings(_write(tmp_path, noise=robustness, truth=TRUE_CPU))
    result = fit_profile(model, timings, TRUE_CPU, "fit", "test")
    fit = result.profile
    assert result.max_abs_error < 1e-6
    for key in ("dense_flops", "attention_flops", "bandwidth", "kv_bandwidth", "pack_bandwidth",
                "launch_s", "per_seq_s", "prefill_step_s"):  # fmt: skip
        assert getattr(fit, key) == pytest.approx(getattr(TRUE_CPU, key), rel=1e-6), key


def test_noisy_timings_fit_within_fifteen_percent(tmp_path) -> None:
    model, timings = load_timings(_write(tmp_path, noise=0.08, seed=3))
    result = fit_profile(model, timings, TRUE, "fit", "test")
    assert result.max_abs_error < 0.15
    assert result.profile.dense_flops == pytest.approx(1e12, rel=0.1)


def test_a_term_that_never_decides_becomes_free(tmp_path, robustness: float) -> None:
    no_memory = DeviceProfile("c", 1e12, 2e11, None, 10**9, launch_s=5e-3, per_seq_s=2e-4)
    fit = fit_profile(*load_timings(_write(tmp_path, robustness, truth=no_memory)), no_memory,
                      "fit", "test")  # fmt: skip
    assert fit.profile.bandwidth is None and fit.profile.kv_bandwidth is None
    assert fit.profile.pack_bandwidth is None
    assert fit.max_abs_error < 1e-6


def test_fits_tell_profiles_apart(tmp_path) -> None:
    """Timings of another profile give another fit: the CPU terms appear only when present."""
    gpu = fit_profile(*load_timings(_write(tmp_path, 0.0, truth=TRUE)), TRUE, "a", "t").profile
    cpu = fit_profile(*load_timings(_write(tmp_path, 0.0, truth=TRUE_CPU)), TRUE, "b", "t").profile
    assert gpu.pack_bandwidth is None and cpu.pack_bandwidth == pytest.approx(3e9, rel=1e-6)
    assert cpu.prefill_step_s == pytest.approx(3e-2, rel=1e-6) and gpu.prefill_step_s == 0.0
    assert cpu.dense_flops == pytest.approx(8e10, rel=1e-6) != gpu.dense_flops


@pytest.mark.parametrize("share_of_launch, kept", [(TERM_SHARE_FLOOR / 20, False), (0.05, True)])
def test_a_term_below_the_share_floor_is_dropped(tmp_path, share_of_launch, kept) -> None:
    """per_seq_s at a tiny share of every step (< TERM_SHARE_FLOOR even at B=64) is dropped;
    at 5% of the launch cost per sequence it is kept and recovered."""
    truth = DeviceProfile("s", 1e12, 2e11, 5e10, 10**9, launch_s=5e-3,
                          per_seq_s=5e-3 * share_of_launch / 64, kv_bandwidth=5e10)  # fmt: skip
    fit = fit_profile(*load_timings(_write(tmp_path, 0.0, truth=truth)), truth, "f", "t")
    if kept:
        assert fit.profile.per_seq_s == pytest.approx(truth.per_seq_s, rel=1e-6)
    else:
        assert fit.profile.per_seq_s == 0.0 and fit.max_abs_error < TERM_SHARE_FLOOR


@pytest.mark.parametrize(
    "content, message",
    [
        ({"format": "other"}, "not a conveyor-sim-timings"),
        ({"format": TIMINGS_FORMAT, "model": "smollm2-135m", "samples": []}, "at least"),
        ({"format": TIMINGS_FORMAT, "model": "gpt-9", "samples": []}, "unknown simulated model"),
    ],
)
def test_malformed_timings_are_refused(tmp_path, content, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_timings(path)


def test_calibrate_command_writes_a_loadable_profile(tmp_path, capsys) -> None:
    out = tmp_path / "profile.json"
    assert main(["calibrate", str(_write(tmp_path, noise=0.0)), "-o", str(out)]) == 0
    fitted = load_device(out)
    assert fitted.dense_flops == pytest.approx(1e12, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(5e10, rel=1e-6)
    assert "max |error| 0.0%" in capsys.readouterr().out
    # a fit that misses by more than --max-error fails the command (the profile is still written)
    assert main(["calibrate", str(_write(tmp_path, noise=0.3, seed=1)), "-o", str(out),
                 "--max-error", "0.01"]) == 1  # fmt: skip


def test_predict_command_prints_simulated_times(capsys) -> None:
    assert main(["predict", "--sim-device", "h200", "--batch-sizes", "1,64"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("SIMULATED step times: llama-3-8b on h200")
    assert "decode B=64 ctx=512" in text and "memory" in text
