"""Fit a device profile's free coefficients to measured step timings (least squares).

The cost model (cost_model.py) is
    t = launch + per_seq * B + chunk * prefill_step
        + max(lin / dense + attn / attention, W / bw + KV / kv_bw + multi * W / pack_bw)
(`chunk`: the step holds a prompt chunk; `multi`: it computes more than one token). With the
inverse rates as unknowns, each branch of the max is linear, so the fit alternates:
assign every sample to the branch that decides it, solve one non-negative least-squares problem
over relative errors, re-assign, until the assignment stops changing. It starts from every split
of the samples by arithmetic intensity (FLOPs per byte) and keeps the best, since the branch
boundary is not known beforehand.

Deciding that a term is absent never rests on an exact zero: the last bits of a least-squares
solve differ between CPUs and BLAS kernels (a coefficient that is 0 on one machine comes back as
1e-26 on another). Two documented thresholds, relative to the data, decide instead:
* TERM_SHARE_FLOOR: a term whose part of every sample's predicted time is below this fraction
  is dropped and the fit redone without it (a dropped rate is None, a dropped overhead 0.0);
* RMS_TOLERANCE: among the fits from all starting splits, those whose RMS relative error is
  within this of the best are equally good, and the one with the fewest terms wins.

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

TIMINGS_FORMAT = "conveyor-sim-timings/1"
MAX_ALTERNATIONS = 50
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
_COMPUTE = slice(3, 5)
_MEMORY = slice(5, 8)
_Features = tuple[np.ndarray, np.ndarray, np.ndarray]  # overheads, compute, memory (_features)
# A term below 0.1% of every sample's time changes no prediction by more than 0.1%, far inside
# the 15% the calibration promises, and far above the ~1e-16 relative noise of a solve.
TERM_SHARE_FLOOR = 1e-3
# 0.01% RMS relative error: far below measurement noise (a few %), far above rounding.
RMS_TOLERANCE = 1e-4


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


def _features(works: list[StepWork]) -> _Features:
    """[N, 3] overheads (1, B, chunk), [N, 2] compute (lin, attn), [N, 3] memory
    (W, KV, multi * W): each row times its coefficients is that part of the step's time."""
    over = np.array([[1.0, w.num_seqs, float(w.has_chunk)] for w in works])
    comp = np.array([[w.linear_flops, w.attention_flops] for w in works])
    mem = np.array([[w.weight_bytes, w.kv_bytes, w.weight_bytes * (w.num_tokens > 1)]
                    for w in works])  # fmt: skip
    return over, comp, mem


def _design(features: _Features, memory_branch: np.ndarray) -> np.ndarray:
    """[N, 8] rows: the overheads, then the compute features where compute decides the step,
    the memory features elsewhere (zeros in the other branch's columns)."""
    over, comp, mem = features
    rows = np.zeros((len(memory_branch), NUM_COEFFS))
    rows[:, :3] = over
    rows[:, _COMPUTE] = comp * ~memory_branch[:, None]
    rows[:, _MEMORY] = mem * memory_branch[:, None]
    return rows


def nonneg_lstsq(a: np.ndarray, b: np.ndarray, allowed: Optional[np.ndarray] = None) -> np.ndarray:
    """argmin ||a x - b|| with x >= 0 and x[j] = 0 where not `allowed[j]`: drop the most
    negative coefficient and re-solve.

    Columns are scaled to unit norm first (FLOPs and bytes differ by 10+ orders of magnitude).
    A column of exact zeros (a feature no sample has: counts and masks, not computed values)
    gets coefficient 0.
    """
    norms = np.linalg.norm(a, axis=0)
    allowed = np.ones(a.shape[1], dtype=bool) if allowed is None else allowed
    active = [j for j in range(a.shape[1]) if allowed[j] and norms[j] > 0]
    x = np.zeros(a.shape[1])
    while active:
        scaled = a[:, active] / norms[active]
        sol, *_ = np.linalg.lstsq(scaled, b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol / norms[active]
            return x
        active.pop(int(np.argmin(sol)))
    return x


def _deciding_branch(features: _Features, coeffs: np.ndarray) -> np.ndarray:
    """[N] True where the memory side of the max decides the step (as step_cost decides)."""
    _, comp, mem = features
    return mem @ coeffs[_MEMORY] > comp @ coeffs[_COMPUTE]


def _fit_branches(
    features: _Features, y: np.ndarray, start: np.ndarray, allowed: np.ndarray
) -> np.ndarray:
    """Alternate branch assignment and least squares from one starting assignment."""
    memory_branch = start.copy()
    coeffs = np.zeros(NUM_COEFFS)
    for _ in range(MAX_ALTERNATIONS):
        a = _design(features, memory_branch) / y[:, None]  # relative error: rows over t
        coeffs = nonneg_lstsq(a, np.ones(len(y)), allowed)
        new = _deciding_branch(features, coeffs)
        if (new == memory_branch).all():
            break
        memory_branch = new
    return coeffs


def term_shares(features: _Features, coeffs: np.ndarray) -> np.ndarray:
    """[N, 8] each term's part of each sample's predicted time (0 where its branch of the max
    does not decide that sample)."""
    parts = _design(features, _deciding_branch(features, coeffs)) * coeffs
    total = parts.sum(axis=1)
    return parts / np.where(total > 0, total, 1.0)[:, None]


def _fit_pruned(features: _Features, y: np.ndarray, start: np.ndarray) -> np.ndarray:
    """A fit from `start` without the terms below TERM_SHARE_FLOOR of every sample's time:
    drop them, refit, until every remaining term matters somewhere."""
    allowed = np.ones(NUM_COEFFS, dtype=bool)
    while True:
        coeffs = _fit_branches(features, y, start, allowed)
        weak = allowed & (term_shares(features, coeffs).max(axis=0) < TERM_SHARE_FLOOR)
        if not weak.any():
            return np.where(allowed, coeffs, 0.0)
        allowed &= ~weak


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
    features = _features(works)
    y = np.array([t.seconds for t in timings])
    intensity = np.array([(w.linear_flops + w.attention_flops) / w.memory_bytes for w in works])
    order = np.argsort(intensity)
    candidates: list[tuple[float, int, DeviceProfile]] = []  # (RMS error, terms, profile)
    for split in range(len(works) + 1):  # the least intense `split` samples start memory-bound
        start = np.zeros(len(works), dtype=bool)
        start[order[:split]] = True
        coeffs = _fit_pruned(features, y, start)
        profile = _profile(coeffs, base, name, source)
        pred = np.array([step_cost(profile, w).total_s for w in works])
        rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
        candidates.append((rms, int(np.count_nonzero(coeffs)), profile))
    best_rms = min(c[0] for c in candidates)
    good = [c for c in candidates if c[0] <= best_rms + RMS_TOLERANCE]
    profile = min(good, key=lambda c: (c[1], c[0]))[2]
    predicted = [step_cost(profile, w).total_s for w in works]
    return FitResult(profile, predicted, [t.seconds for t in timings])
