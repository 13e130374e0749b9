"""Fit a device profile's free coefficients to measured step timings (least squares).

The cost model (cost_model.py) is
    t = launch + per_seq * B + chunk * prefill_step
        + max(lin / dense + attn / attention, W / bw + KV / kv_bw + multi * W / pack_bw)
(`chunk`: the step holds a prompt chunk; `multi`: it computes more than one token). With the
inverse rates as unknowns, each branch of the max is linear: the fit is shared/step_cost.py's
(alternating branch assignment and non-negative least squares over relative errors, with its
documented thresholds deciding which terms are absent), which the scheduler's online step-time
predictor uses too.

Timings file (written by `conveyor sim measure`):
    {"format": "conveyor-sim-timings/1", "model": "smollm2-135m", ...,
     "samples": [{"start_positions": [...], "num_tokens": [...], "num_sampled": k,
                  "seconds": [t, ...]}, ...]}
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from services.worker.sim.cost_model import StepWork, step_cost, step_work
from services.worker.sim.profiles import DeviceProfile, ModelShape, get_model
from shared import step_cost as step_cost_fit
from shared.step_cost import TERM_SHARE_FLOOR, Features

__all__ = ["TERM_SHARE_FLOOR", "TIMINGS_FORMAT", "FitResult", "fit_profile", "load_timings"]

TIMINGS_FORMAT = "conveyor-sim-timings/1"
# columns of the design matrix, in this order
COEFFS = (
    "launch_s",
    "per_seq_s",
    "prefill_step_s",
    "1/dense_flops",
    "1/attention_flops",
    "1/bandwidth",
    "1/kv_bandwidth",
    "1/pack_bandwidth",
)
NUM_COEFFS = len(COEFFS)


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured step shape and its time (the median of its repeats)."""

    start_positions: list[int]
    num_tokens: list[int]
    num_sampled: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FitResult:
    profile: DeviceProfile
    predicted: list[float]  # [N] seconds, in sample order
    measured: list[float]  # [N]

    @property
    def relative_errors(self) -> list[float]:
        return [(p - m) / m for p, m in zip(self.predicted, self.measured, strict=True)]

    @property
    def max_abs_error(self) -> float:
        return max(abs(e) for e in self.relative_errors)


def load_timings(path: Path) -> tuple[ModelShape, list[Timing]]:
    """Parse a timings file; ValueError with the reason when it is malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read timings {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != TIMINGS_FORMAT:
        raise ValueError(f"{path}: not a {TIMINGS_FORMAT} file")
    model = get_model(str(data.get("model")))
    samples = [_timing(s, i) for i, s in enumerate(data.get("samples") or [])]
    if len(samples) < NUM_COEFFS:
        raise ValueError(f"{path}: need at least {NUM_COEFFS} samples, got {len(samples)}")
    return model, samples


def _timing(s: Any, i: int) -> Timing:
    try:
        t = Timing(
            [int(x) for x in s["start_positions"]],
            [int(x) for x in s["num_tokens"]],
            int(s["num_sampled"]),
            float(statistics.median(float(x) for x in s["seconds"])),
        )
    except (KeyError, TypeError, ValueError, statistics.StatisticsError) as e:
        raise ValueError(f"sample {i} is malformed: {e!r}") from None
    if len(t.start_positions) != len(t.num_tokens) or not t.num_tokens or t.seconds <= 0:
        raise ValueError(f"sample {i}: empty, ragged or non-positive time")
    return t


def _work(model: ModelShape, t: Timing) -> StepWork:
    return step_work(model, t.start_positions, t.num_tokens, t.num_sampled)


def _features(works: list[StepWork]) -> Features:
    """[N, 3] overheads (1, B, chunk), [N, 2] compute (lin, attn), [N, 3] memory
    (W, KV, multi * W): each row times its coefficients is that part of the step's time."""
    over = np.array([[1.0, w.num_seqs, float(w.has_chunk)] for w in works])
    comp = np.array([[w.linear_flops, w.attention_flops] for w in works])
    mem = np.array([[w.weight_bytes, w.kv_bytes, w.weight_bytes * (w.num_tokens > 1)]
                    for w in works])  # fmt: skip
    return over, comp, mem


def _profile(coeffs: np.ndarray, base: DeviceProfile, name: str, source: str) -> DeviceProfile:
    def rate(c: float) -> Optional[float]:
        return 1.0 / c if c > 0 else None

    return DeviceProfile(
        name=name,
        dense_flops=rate(coeffs[3]),
        attention_flops=rate(coeffs[4]),
        bandwidth=rate(coeffs[5]),
        memory_bytes=base.memory_bytes,
        launch_s=float(coeffs[0]),
        per_seq_s=float(coeffs[1]),
        memory_utilization=base.memory_utilization,
        source=source,
        kv_bandwidth=rate(coeffs[6]),
        pack_bandwidth=rate(coeffs[7]),
        prefill_step_s=float(coeffs[2]),
    )


def fit_profile(
    model: ModelShape, timings: list[Timing], base: DeviceProfile, name: str, source: str
) -> FitResult:
    """The profile minimizing squared relative error over `timings` (memory from `base`)."""
    works = [_work(model, t) for t in timings]
    coeffs = step_cost_fit.fit(_features(works), np.array([t.seconds for t in timings]))
    profile = _profile(coeffs, base, name, source)
    predicted = [step_cost(profile, w).total_s for w in works]
    return FitResult(profile, predicted, [t.seconds for t in timings])
