"""The step-time model both the simulated worker's calibration and the scheduler fit, and the
scheduler's online predictor built on it.

The model (services/worker/sim/cost_model.py has it in device terms):
    t = overheads . c_o + max(compute . c_c, memory . c_m),   every coefficient >= 0
With the coefficients as unknowns each branch of the max is linear, so the fit alternates:
assign every sample to the branch that decides it, solve one non-negative least-squares problem
over relative errors, re-assign, until the assignment stops changing. It starts from splits of
the samples by arithmetic intensity (compute over memory features) and keeps the best, since
the branch boundary is not known beforehand.

Deciding that a term is absent never rests on an exact zero: the last bits of a least-squares
solve differ between CPUs and BLAS kernels. Two documented thresholds decide instead:
* TERM_SHARE_FLOOR: a term whose part of every sample's predicted time is below this fraction
  is dropped and the fit redone without it;
* RMS_TOLERANCE: among the fits from all starting splits, those whose RMS relative error is
  within this of the best are equally good, and the one with the fewest terms wins.

The scheduler's features of a step (`StepShape`) are what it decides and the worker's result
reports: rows, tokens computed, samples, attention pairs and KV tokens read. In those terms the
simulated worker's cost model is exactly of this form (weights and rates are constants), so
the online fit can recover it; a real worker's p90 error is what `engine_summary` reports.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shared.step_samples import StepSamples

MAX_ALTERNATIONS = 50
# A term below 0.1% of every sample's time changes no prediction by more than 0.1%, far inside
# the 15% the calibration promises, and far above the ~1e-16 relative noise of a solve.
TERM_SHARE_FLOOR = 1e-3
# 0.01% RMS relative error: far below measurement noise (a few %), far above rounding.
RMS_TOLERANCE = 1e-4

# The online fit's share of the engine's time: a refit is due once the steps since the last
# took 1 / FIT_SHARE times that fit (and at least MIN_REFIT_STEPS steps arrived).
FIT_SHARE = 0.01
MIN_REFIT_STEPS = 16
# A fit is stale when steps surprise it: MIN_SURPRISES steps since it missed by more than
# SURPRISE_ERROR (10% step-time noise gives such a miss about once in 10^5 steps) make a full
# fit due, with every starting split (a fit from the current branches cannot find a branch it
# has no sample in: on the simulated 70B, decode-only first steps left prompt chunks predicted
# at a tenth of their time until the next full fit; docs/lab/2026-12-slo.md), once the steps
# since took 1 / SURPRISE_FIT_SHARE times a full fit.
SURPRISE_ERROR = 0.5
MIN_SURPRISES = 4
SURPRISE_FIT_SHARE = 0.1

# [N, k] feature blocks: overheads, compute, memory (each row times its coefficients is that
# part of the step's time)
Features = tuple[np.ndarray, np.ndarray, np.ndarray]


def _widths(features: Features) -> tuple[slice, slice]:
    over, comp, _ = features
    a, b = over.shape[1], over.shape[1] + comp.shape[1]
    return slice(a, b), slice(b, None)


def design(features: Features, memory_branch: np.ndarray) -> np.ndarray:
    """[N, k] rows: the overheads, then the compute features where compute decides the step,
    the memory features elsewhere (zeros in the other branch's columns)."""
    over, comp, mem = features
    c, m = _widths(features)
    rows = np.zeros((len(memory_branch), over.shape[1] + comp.shape[1] + mem.shape[1]))
    rows[:, : over.shape[1]] = over
    rows[:, c] = comp * ~memory_branch[:, None]
    rows[:, m] = mem * memory_branch[:, None]
    return rows


def nonneg_lstsq(a: np.ndarray, b: np.ndarray, allowed: Optional[np.ndarray] = None) -> np.ndarray:
    """argmin ||a x - b|| with x >= 0 and x[j] = 0 where not `allowed[j]`: drop the most
    negative coefficient and re-solve.

    Columns are scaled to unit norm first (FLOPs and bytes differ by 10+ orders of magnitude).
    A column of exact zeros (a feature no sample has) gets coefficient 0.
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


def deciding_branch(features: Features, coeffs: np.ndarray) -> np.ndarray:
    """[N] True where the memory side of the max decides the step."""
    _, comp, mem = features
    c, m = _widths(features)
    return mem @ coeffs[m] > comp @ coeffs[c]


def predict(features: Features, coeffs: np.ndarray) -> np.ndarray:
    """[N] modelled seconds."""
    over, comp, mem = features
    c, m = _widths(features)
    return over @ coeffs[: over.shape[1]] + np.maximum(comp @ coeffs[c], mem @ coeffs[m])


def term_shares(features: Features, coeffs: np.ndarray) -> np.ndarray:
    """[N, k] each term's part of each sample's predicted time (0 where its branch of the max
    does not decide that sample)."""
    parts = design(features, deciding_branch(features, coeffs)) * coeffs
    total = parts.sum(axis=1)
    return parts / np.where(total > 0, total, 1.0)[:, None]


def _fit_branches(
    features: Features, y: np.ndarray, start: np.ndarray, allowed: np.ndarray
) -> np.ndarray:
    """Alternate branch assignment and least squares from one starting assignment."""
    memory_branch = start.copy()
    coeffs = np.zeros(len(allowed))
    for _ in range(MAX_ALTERNATIONS):
        a = design(features, memory_branch) / y[:, None]  # relative error: rows over t
        coeffs = nonneg_lstsq(a, np.ones(len(y)), allowed)
        new = deciding_branch(features, coeffs)
        if (new == memory_branch).all():
            break
        memory_branch = new
    return coeffs


def _fit_pruned(features: Features, y: np.ndarray, start: np.ndarray) -> np.ndarray:
    """A fit from `start` without the terms below TERM_SHARE_FLOOR of every sample's time:
    drop them, refit, until every remaining term matters somewhere."""
    allowed = np.ones(sum(f.shape[1] for f in features), dtype=bool)
    while True:
        coeffs = _fit_branches(features, y, start, allowed)
        weak = allowed & (term_shares(features, coeffs).max(axis=0) < TERM_SHARE_FLOOR)
        if not weak.any():
            return np.where(allowed, coeffs, 0.0)
        allowed &= ~weak


def starting_splits(features: Features, max_starts: Optional[int] = None) -> list[np.ndarray]:
    """The fit's starting assignments: every split (the least intense `split` samples start
    memory-bound), or `max_starts` of them evenly spaced (the online fit's bound on its work)."""
    _, comp, mem = features
    n = len(comp)
    intensity = comp.sum(axis=1) / np.maximum(mem.sum(axis=1), 1e-30)
    order = np.argsort(intensity)
    splits = range(n + 1)
    if max_starts is not None and max_starts < n + 1:
        splits = sorted({round(i * n / (max_starts - 1)) for i in range(max_starts)})
    starts = []
    for split in splits:
        start = np.zeros(n, dtype=bool)
        start[order[:split]] = True
        starts.append(start)
    return starts


class FitJob:
    """One fit over a fixed set of samples, done one starting assignment at a time
    (`advance`), so that its owner can spread it over several calls; the result is the one
    `fit` gives."""

    def __init__(self, features: Features, y: np.ndarray, starts: list[np.ndarray]) -> None:
        self._features, self._y = features, y
        self._starts = starts
        self._candidates: list[tuple[float, int, np.ndarray]] = []  # (RMS, terms, coeffs)

    @property
    def num_starts(self) -> int:
        return len(self._starts)

    def advance(self) -> Optional[np.ndarray]:
        """Fit from the next starting assignment; the best coefficients once every one was
        tried (fewest terms among those within RMS_TOLERANCE of the best), else None."""
        features, y = self._features, self._y
        coeffs = _fit_pruned(features, y, self._starts[len(self._candidates)])
        rms = float(np.sqrt(np.mean(((predict(features, coeffs) - y) / y) ** 2)))
        self._candidates.append((rms, int(np.count_nonzero(coeffs)), coeffs))
        if len(self._candidates) < len(self._starts):
            return None
        best_rms = min(c[0] for c in self._candidates)
        good = [c for c in self._candidates if c[0] <= best_rms + RMS_TOLERANCE]
        return min(good, key=lambda c: (c[1], c[0]))[2]


def fit(features: Features, y: np.ndarray, max_starts: Optional[int] = None) -> np.ndarray:
    """The coefficients minimizing squared relative error over the samples `y` (seconds),
    from every starting split or `max_starts` of them (`starting_splits`)."""
    job = FitJob(features, y, starting_splits(features, max_starts))
    while (coeffs := job.advance()) is None:
        pass
    return coeffs


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, in the scheduler's terms.

    `attention_pairs`: sum over computed tokens of the keys each attends to (a token at
    position p meets p + 1); `kv_tokens`: KV positions read plus written."""

    num_rows: int
    num_tokens: int
    num_sampled: int
    attention_pairs: int
    kv_tokens: int
    has_chunk: bool  # some row computes more than one token

    def features(self) -> tuple[list[float], list[float], list[float]]:
        """(overheads [1, rows, chunk], compute [tokens, samples, pairs], memory [1, KV,
        multi]): the simulated worker's cost model is linear in each block."""
        multi = float(self.num_tokens > 1)
        return (
            [1.0, float(self.num_rows), float(self.has_chunk)],
            [float(self.num_tokens), float(self.num_sampled), float(self.attention_pairs)],
            [1.0, float(self.kv_tokens), multi],
        )

    def with_drafts(self, drafts: list[int]) -> StepShape:
        """This step with `drafts[j]` more tokens on some of its decodes (speculation: each
        draft is computed and sampled after its decode's token). Their contexts are taken as
        the step's mean start (the scheduler does not walk the rows again)."""
        total = sum(drafts)
        if total == 0:
            return self
        mean_start = max(self.kv_tokens - 2 * self.num_tokens, 0) / max(self.num_rows, 1)
        pairs = sum(n * (mean_start + 1) + n * (n + 1) / 2 for n in drafts)
        return StepShape(self.num_rows, self.num_tokens + total, self.num_sampled + total,
                         self.attention_pairs + round(pairs), self.kv_tokens + 2 * total,
                         True)  # fmt: skip


def step_shape(start_positions: list[int], num_tokens: list[int], num_sampled: int) -> StepShape:
    """The shape of a step whose row b has `start_positions[b]` tokens cached and computes
    `num_tokens[b]`."""
    pairs = sum(n * s + n * (n + 1) // 2 for s, n in zip(start_positions, num_tokens, strict=True))
    total = sum(num_tokens)
    return StepShape(len(num_tokens), total, num_sampled, pairs,
                     sum(start_positions) + 2 * total, any(n > 1 for n in num_tokens))  # fmt: skip


def _stack(shapes: list[StepShape]) -> Features:
    rows = [s.features() for s in shapes]
    return tuple(np.array([r[i] for r in rows]) for i in range(3))  # type: ignore[return-value]


class StepCostPredictor:
    """Step time from its shape, fitted online from the engine's own step log.

    The scheduler calls `observe` with each step's shape and measured time (the worker's
    `forward_s`), `maybe_refit` off the result -> plan path, and `predict` when it decides.
    Each observation is first predicted with the current fit: those out-of-sample relative
    errors are what `errors()` reports (the last `window`). It fits the last `window` steps and
    a reservoir of extreme ones (step_samples.py). Before the first fit, `predict` answers None.
    """

    def __init__(
        self, window: int = 512, refit_every: int = 256, first_fit: int = 64, max_starts: int = 9
    ) -> None:
        """A full fit of `window` steps costs ~30 ms (9 starting splits): the first comes
        after `first_fit` steps, then one every `refit_every`. In between, a fit started from
        the current fit's branches (one start: a few ms) once at least MIN_REFIT_STEPS steps
        took 1 / FIT_SHARE times such a fit (the last fit's time per start): on a CPU
        worker's 10-300 ms steps, every 16; on a GPU's few ms, every few hundred. A fit made
        on the first steps (often one stream's) must not stand for hundreds of loaded ones:
        on the real model that alone made the p90 error 93%
        (docs/lab/2026-12-slo-predictor.md). Off the result -> plan path."""
        self._samples = StepSamples[StepShape](window)  # the window and its reservoir
        self._errors: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._first_fit = first_fit
        self._max_starts = max_starts
        self._since_fit = self._since_full = 0
        self._seconds_since_fit = 0.0
        self._num_surprises = 0  # steps since the last fit that it missed by SURPRISE_ERROR
        self._one_start_s = 0.0  # how long the last fit took per starting split
        self._coeffs: Optional[np.ndarray] = None
        self._job: Optional[FitJob] = None  # the fit under way (one start per maybe_refit)
        self._job_s = 0.0  # its time so far
        self._job_multi = False  # its samples had a multi-token row
        self.num_fits = 0
        # the last fit saw a step where some row computed more than one token (a prompt
        # chunk, drafts): only then can it tell a token's cost from a row's
        self.fitted_multi_token_rows = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0:
            return
        guess = self.predict(shape)
        if guess is not None:
            error = abs(guess - seconds) / seconds
            self._errors.append(error)
            self._num_surprises += error > SURPRISE_ERROR
        self._samples.add(shape, seconds)
        self._since_fit += 1
        self._since_full += 1
        self._seconds_since_fit += seconds

    def maybe_refit(self) -> bool:
        """Called once per step off the result -> plan path: starts a fit when due (`first_fit`
        steps for the first; then see `__init__`) and does one starting split of the fit under
        way, so a full fit (9 starts, ~30 ms) is spread over 9 calls: the scheduler answers its
        frontends between them (a refusal waited 130 ms for a whole fit at 2x load on the
        simulated 70B, docs/lab/2026-12-slo.md). True when a fit was completed."""
        if self._job is None:
            if self._coeffs is None:
                due = full = self._since_fit >= self._first_fit
            else:
                full = self._since_full >= self._refit_every or self._surprised()
                long_enough = self._seconds_since_fit * FIT_SHARE >= self._one_start_s
                due = full or (self._since_fit >= MIN_REFIT_STEPS and long_enough)
            if not due:
                return False
            self._start_fit(full)
        return self._advance_fit()

    def _surprised(self) -> bool:
        """Whether enough steps since the last fit missed it by far (SURPRISE_ERROR) and took
        long enough to pay for a full fit."""
        full_fit_s = self._one_start_s * self._max_starts
        return (
            self._num_surprises >= MIN_SURPRISES
            and self._seconds_since_fit * SURPRISE_FIT_SHARE >= full_fit_s
        )

    def fit_now(self, full: bool = True) -> None:
        """A whole fit at once (every starting split, or one from the current fit's branches),
        after finishing one under way."""
        while self._job is not None:
            self._advance_fit()
        self._start_fit(full)
        while not self._advance_fit():
            pass

    def _start_fit(self, full: bool) -> None:
        """A fit over the steps seen so far: every starting split, or (`full` False, a fit
        standing) one start from the current fit's branch assignment."""
        shapes, times = self._samples.samples()
        features, seconds = _stack(shapes), np.array(times)
        if full or self._coeffs is None:
            starts = starting_splits(features, self._max_starts)
            self._since_full = 0
        else:
            starts = [deciding_branch(features, self._coeffs)]
        self._job = FitJob(features, seconds, starts)
        self._job_s = 0.0
        self._job_multi = any(s.has_chunk for s in shapes)
        self._since_fit, self._seconds_since_fit = 0, 0.0

    def _advance_fit(self) -> bool:
        """One starting split of the fit under way; True when that finished it (its
        coefficients now predict)."""
        job = self._job
        assert job is not None
        began = time.perf_counter()
        coeffs = job.advance()
        self._job_s += time.perf_counter() - began
        if coeffs is None:
            return False
        self._coeffs, self._job = coeffs, None
        self.fitted_multi_token_rows = self._job_multi
        self._num_surprises = 0  # misses of the fit before this one
        self._one_start_s = self._job_s / job.num_starts
        self.num_fits += 1
        return True

    def predict(self, shape: StepShape) -> Optional[float]:
        """Modelled seconds of a step of this shape; None before the first fit."""
        c = self._coeffs
        if c is None:
            return None
        over, comp, mem = shape.features()
        t_over = over[0] * c[0] + over[1] * c[1] + over[2] * c[2]
        t_comp = comp[0] * c[3] + comp[1] * c[4] + comp[2] * c[5]
        t_mem = mem[0] * c[6] + mem[1] * c[7] + mem[2] * c[8]
        return float(t_over + max(t_comp, t_mem))

    def errors(self) -> Optional[tuple[float, float]]:
        """(p50, p90) of the recent out-of-sample relative errors; None before any."""
        if not self._errors:
            return None
        p50, p90 = np.quantile(np.array(self._errors), [0.5, 0.9])
        return float(p50), float(p90)
