"""Replay real-model step logs through the step-time predictor (shared/step_cost.py), offline
and deterministic, to test what limits its p90 error (issue 33; docs/lab/2026-12-slo-drift.md).

For each log (a bench run's `logs/<config>/scheduler.log`, steps with `shape`, `forward_s`):
* live: the plan-time `predicted_s` the run logged against the time the predictor learns;
* replay: the predictor fed the log in order, each step predicted when `--lag` results were
  still out (1: the scheduler plans a step while the one before it runs); every fit's starting
  split is taken to cost `--start-ms` on a fake clock, so the refit cadence does not follow
  this machine's timing;
* drift-corrected replays: the prediction times the median (or EWMA of the log) of actual /
  predicted over the last k steps' results (a slow drift of the machine, which a fit over a
  512-step window cannot follow, would show as a gain here);
* a local oracle: each decode-only step predicted by the median time of the steps of the same
  rows, no chunk and KV tokens within 5% among the 8 steps either side (it knows the shape's
  local level, the future included): about the least error a prediction from the step's
  shape and the steps before it can reach.

    PYTHONPATH=. .venv/bin/python bench/slo_predictor_replay.py LOG [LOG ...] [--k 4 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np

import shared.step_cost as step_cost
from shared.step_cost import StepCostPredictor, StepShape

Step = tuple[StepShape, float, Optional[float]]  # shape, seconds learned, predicted at plan
NEIGHBOURS = 8


def load_steps(path: Path) -> list[Step]:
    """The learned steps: the time is the one services/scheduler/step_costs.py learns."""
    steps = []
    for line in path.read_text().splitlines():
        if '"event":"step"' not in line:
            continue
        entry = json.loads(line)
        forward_s, step_s = entry.get("forward_s"), entry.get("step_s")
        if not entry.get("shape") or not forward_s:
            continue
        seconds = forward_s if step_s is None else min(forward_s, max(step_s, forward_s / 2))
        steps.append((StepShape(*entry["shape"]), seconds, entry.get("predicted_s")))
    return steps


class FakeClock:
    """`time` for shared.step_cost: every read advances by half a starting split's cost."""

    def __init__(self, start_s: float) -> None:
        self._now, self._half = 0.0, start_s / 2

    def perf_counter(self) -> float:
        self._now += self._half
        return self._now


class Correction:
    """A multiplier from the last k results: median of actual / predicted (recomputed under the
    current fit), or the EWMA of its log (alpha 2 / (k + 1), as observed)."""

    def __init__(self, kind: str, k: int) -> None:
        self.kind, self.k = kind, k
        self._recent: deque[tuple[StepShape, float]] = deque(maxlen=k)
        self._log_ewma: Optional[float] = None

    def observe(self, predictor: StepCostPredictor, shape: StepShape, seconds: float) -> None:
        guess = predictor.predict(shape)
        if guess is None or self.kind == "none":
            return
        self._recent.append((shape, seconds))
        x, alpha = math.log(seconds / guess), 2 / (self.k + 1)
        self._log_ewma = x if self._log_ewma is None else (1 - alpha) * self._log_ewma + alpha * x
        if self.kind == "ewma":
            self._recent.clear()

    def factor(self, predictor: StepCostPredictor) -> float:
        if self.kind == "ewma" and self._log_ewma is not None:
            return math.exp(self._log_ewma)
        if self.kind != "median" or not self._recent:
            return 1.0
        ratios = [t / (predictor.predict(s) or t) for s, t in self._recent]
        return float(np.median(ratios))


def replay(
    steps: list[Step], correction: Correction, lag: int, start_s: float
) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-sample relative errors, each step predicted with `lag` results still out, and
    which of those steps were decode-only."""
    step_cost.time = FakeClock(start_s)  # type: ignore[assignment]  # the cadence, not timing
    predictor, errors, decodes = StepCostPredictor(), [], []
    for i, (shape, seconds, _) in enumerate(steps):
        j = i - 1 - lag  # the newest step whose result is in when step i is planned
        if j >= 0:
            done_shape, done_s, _ = steps[j]
            correction.observe(predictor, done_shape, done_s)
            predictor.observe(done_shape, done_s)
            predictor.maybe_refit()
        guess = predictor.predict(shape)
        if guess is not None:
            errors.append(abs(guess * correction.factor(predictor) - seconds) / seconds)
            decodes.append(not shape.has_chunk)
    return np.array(errors), np.array(decodes)


def oracle_errors(steps: list[Step]) -> np.ndarray:
    """The local oracle's relative errors on decode-only steps with >= 3 such neighbours."""
    errors = []
    for i, (shape, seconds, _) in enumerate(steps):
        if shape.has_chunk:
            continue
        lo = max(0, i - NEIGHBOURS)
        near = [t for j, (s, t, _) in enumerate(steps[lo : i + NEIGHBOURS + 1], start=lo)
                if j != i and s.num_rows == shape.num_rows and not s.has_chunk
                and abs(s.kv_tokens - shape.kv_tokens) <= 0.05 * shape.kv_tokens]  # fmt: skip
        if len(near) >= 3:
            errors.append(abs(float(np.median(near)) - seconds) / seconds)
    return np.array(errors)


def _cell(errors: np.ndarray) -> str:
    p50, p90 = np.quantile(errors, [0.5, 0.9]) * 100
    return f"{p50:.1f} / {p90:.1f}"


def _row(name: str, cells: list[str]) -> None:
    print(f"| {name} |", " | ".join(cells), "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--k", nargs="+", type=int, default=[4, 8, 16, 32])
    parser.add_argument("--lag", type=int, default=1)
    parser.add_argument("--start-ms", type=float, default=3.0)
    parser.add_argument("--skip", type=int, default=0, help="errors left out at the start")
    args = parser.parse_args()
    runs = [load_steps(path) for path in args.logs]
    _row("p50 / p90 %", [f"log {n + 1} ({len(steps)} steps)" for n, steps in enumerate(runs)])
    print("|---|" + "---:|" * len(runs))
    live = [np.array([abs(p - t) / t for _, t, p in steps if p is not None]) for steps in runs]
    _row("live (plan time)", [_cell(errors) for errors in live])
    for kind, k in [("none", 1)] + [(kind, k) for kind in ("median", "ewma") for k in args.k]:
        results = [replay(s, Correction(kind, k), args.lag, args.start_ms / 1000) for s in runs]
        _row("replay" if kind == "none" else f"replay, {kind} k={k}",
             [_cell(errors[args.skip :]) for errors, _ in results])  # fmt: skip
        if kind == "none":
            _row("replay, decode-only steps", [_cell(e[d]) for e, d in results])
    _row("local oracle (decode-only)", [_cell(oracle_errors(s)) for s in runs])


if __name__ == "__main__":
    main()
