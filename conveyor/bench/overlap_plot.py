"""A per-step timeline of the scheduler against the worker, from the scheduler's step log: does
the scheduler's own work overlap the worker's step (`--async-scheduling`) or sit between steps?

For a window of consecutive steps in the middle of each run, two rows per panel: the worker's
step (its `forward_s`, ending when the result arrived) and the scheduler's path from a result to
the next plan (`gap_s`, ending when that plan left). One panel per run, the same time scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window

import matplotlib.pyplot as plt  # noqa: E402

from conveyor.bench.steplog import StepEntry, read_step_log  # noqa: E402

WINDOW_STEPS = 10
COLORS = {"worker": "#4e79a7", "scheduler": "#f28e2b"}


def _window(steps: Sequence[StepEntry]) -> list[StepEntry]:
    middle = len(steps) // 2
    return list(steps[middle : middle + WINDOW_STEPS])


def plot_overlap(logs: Sequence[Path], labels: Sequence[str], path: Path) -> Path:
    """One panel per scheduler log (`labels` name them); returns `path`."""
    fig, axes = plt.subplots(len(logs), 1, figsize=(12, 1.2 + 1.4 * len(logs)), squeeze=False)
    for ax, log, label in zip(axes[:, 0], logs, labels, strict=True):
        _panel(ax, _window(read_step_log(log)), label)
    axes[-1, 0].set_xlabel("ms since the first step of the window")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS]
    fig.legend(handles, ["worker step (forward_s)", "scheduler: result -> next plan (gap_s)"],
               loc="upper right", ncol=2, fontsize=8, frameon=False)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax: plt.Axes, steps: list[StepEntry], label: str) -> None:
    if not steps:
        ax.set_title(f"{label}: no steps", fontsize=9, loc="left")
        return
    t0 = min(s.t_plan - (s.gap_s or 0.0) for s in steps)
    ms = 1e3
    worker = [((s.t_result - (s.forward_s or 0.0) - t0) * ms, (s.forward_s or 0.0) * ms)
              for s in steps]  # fmt: skip
    sched = [((s.t_plan - s.gap_s - t0) * ms, s.gap_s * ms) for s in steps if s.gap_s is not None]
    ax.broken_barh(worker, (1.1, 0.8), color=COLORS["worker"], edgecolor="white", linewidth=0.5)
    ax.broken_barh(sched, (0.1, 0.8), color=COLORS["scheduler"], edgecolor="white", linewidth=0.5)
    ax.set_yticks([0.5, 1.5])
    ax.set_yticklabels(["scheduler", "worker"], fontsize=8)
    ax.set_title(label, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)
