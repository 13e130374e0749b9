"""The benchmark's pictures (PNG, matplotlib's Agg backend: no display needed).

* latency CDFs (TTFT, TPOT, ITL, E2EL), one curve per run;
* throughput and latency against concurrency or request rate (a sweep);
* the timeline of a run, drawn from the scheduler's step log: one row per request with its wait
  (arrival -> first scheduled), its prefill chunks and its decode steps (marked where it missed
  its latency targets), and the batch size over time underneath;
* the steps of several runs one above the other (a comparison): when each step ran, on a row
  for steps with prompt tokens and one for steps with decodes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from conveyor.bench.metrics import RequestTrace  # noqa: E402
from conveyor.bench.steplog import RequestSpans, StepEntry, request_spans  # noqa: E402

COLORS = {"wait": "#d9d9d9", "prefill": "#f28e2b", "decode": "#4e79a7", "idle": "#bab0ac"}
MISSED_COLOR = "#e15759"
MAX_TIMELINE_ROWS = 400  # beyond this a row is under a pixel: draw the first ones only


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestTrace]], path: Path) -> Path:
    """One panel per latency metric; one curve per named run."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for label, traces in runs.items():
        done = [t for t in traces if t.success]
        samples = {
            "TTFT": [t.ttft for t in done if t.ttft is not None],
            "TPOT": [t.tpot for t in done if t.tpot is not None],
            "ITL": [g for t in done for g in t.itls],
            "E2E latency": [t.latency for t in done if t.latency is not None],
        }
        for ax, (name, values) in zip(axes, samples.items(), strict=True):
            if values:
                ms = np.sort(np.asarray(values) * 1000.0)
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=label)
            ax.set_title(name)
            ax.set_xlabel("ms")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(
    xs: Sequence[float], results: Sequence[Mapping[str, object]], x_label: str, path: Path
) -> Path:
    """Throughput (left) and mean/p99 latency (right) against the swept quantity."""
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    ax_t.plot(xs, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    ax_t.plot(xs, [r["total_token_throughput"] for r in results], "s--", label="total tok/s")
    ax_t.set_ylabel("tokens / s")
    for key, style in (
        ("mean_ttft_ms", "o-"),
        ("p99_ttft_ms", "o:"),
        ("mean_tpot_ms", "s-"),
        ("p99_tpot_ms", "s:"),
        ("mean_e2el_ms", "^-"),
    ):
        if all(key in r for r in results):
            ax_l.plot(xs, [r[key] for r in results], style, label=key)
    ax_l.set_ylabel("ms")
    ax_l.set_yscale("log")
    spread = min(xs) > 0 and max(xs) / min(xs) >= 8
    for ax in (ax_t, ax_l):
        if spread:  # 1, 4, 16, 64 ...: evenly spaced on a log axis
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_timeline(
    steps: Sequence[StepEntry],
    arrivals: Mapping[str, float],
    path: Path,
    output_lens: Optional[Mapping[str, int]] = None,
    title: str = "",
    missed: Collection[str] = (),
) -> int:
    """Draws one row per request scheduled in `steps`; returns the number of rows drawn.

    arrivals: engine rid -> time.time() the client sent it (the start of its wait bar);
    output_lens: engine rid -> output tokens, so that static padding steps show as such;
    missed: engine rids of requests that missed their latency targets (`mark_missed`).
    When `arrivals` is not empty, only its requests get rows (other traffic on a shared engine
    still counts in the batch panel). Time 0 is the earliest arrival or step."""
    spans = [s for s in request_spans(steps, arrivals, output_lens) if s.first_scheduled]
    if arrivals:
        spans = [s for s in spans if s.rid in arrivals]
    spans.sort(key=lambda s: (s.arrival, s.first_scheduled))
    spans = spans[:MAX_TIMELINE_ROWS]
    t0 = min([s.arrival for s in spans] + [st.t_plan for st in steps] or [0.0])
    n = len(spans)
    ratios = [max(3, min(n, 60) // 4), 1.4]
    fig, (ax, ax_b) = plt.subplots(2, 1, figsize=(12, 2.5 + min(n, 60) * 0.18), sharex=True,
                                   gridspec_kw={"height_ratios": ratios})  # fmt: skip
    for row, span in enumerate(spans):
        _draw_row(ax, n - 1 - row, span, t0)
    ax.set_yticks(range(n))
    ax.set_yticklabels([_short(s.rid) for s in reversed(spans)], fontsize=6 if n > 30 else 8)
    mark_missed(ax, spans, missed, t0)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_ylabel("request")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("wait", "prefill", "decode")]
    labels = ["waiting", "prefill chunk", "decode step"]
    if any(s.idle for s in spans):
        handles.append(plt.Rectangle((0, 0), 1, 1, color=COLORS["idle"], hatch="//"))
        labels.append("finished, slot still computed (static)")
    if any(s.rid in missed for s in spans):
        handles.append(plt.Line2D([], [], color=MISSED_COLOR, marker="x", ls=""))
        labels.append("missed its latency target")
    ax.legend(
        handles,
        labels,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        ncol=len(labels),
        frameon=False,
    )
    fig.suptitle(
        title or "Requests joining and leaving the batch (from the scheduler's step log)",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    _draw_batch(ax_b, steps, t0)
    _save(fig, path)
    return n


def plot_step_strips(runs: Mapping[str, Sequence[StepEntry]], path: Path, title: str = "") -> Path:
    """One panel per named run, two rows: every step that computes prompt tokens is a box on
    the upper row, every step that decodes one on the lower row, over the time the worker ran
    it (its `forward_s` before its result; else plan to result), in seconds since the run's
    first step. A mixed step shows on both rows at once; compositions that separate prefill
    and decode show boxes on one row at a time."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12, 0.8 + 1.1 * len(runs)), sharex=True, squeeze=False
    )
    for ax, (label, steps) in zip(axes[:, 0], runs.items(), strict=True):
        t0 = min((_ran(s)[0] for s in steps), default=0.0)
        prompt = [(a - t0, b - a) for s in steps if any(s.is_prefill) for a, b in [_ran(s)]]
        decode = [(a - t0, b - a) for s in steps if not all(s.is_prefill) for a, b in [_ran(s)]]
        ax.broken_barh(prompt, (1.1, 0.8), color=COLORS["prefill"], linewidth=0)
        ax.broken_barh(decode, (0.1, 0.8), color=COLORS["decode"], linewidth=0)
        ax.set_yticks([0.5, 1.5])
        ax.set_yticklabels(["decodes", "prompts"], fontsize=7)
        ax.set_ylim(0, 2)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("seconds since the run's first step")
    fig.suptitle(title or "steps", fontsize=10, x=0.01, ha="left")
    return _save(fig, path)


def _ran(step: StepEntry) -> tuple[float, float]:
    """When the worker ran the step: its forward time before its result, when logged."""
    if step.forward_s is not None and 0 < step.forward_s <= step.step_s:
        return step.t_result - step.forward_s, step.t_result
    return step.t_plan, step.t_result


def _draw_row(ax: plt.Axes, y: float, span: RequestSpans, t0: float) -> None:
    if span.first_scheduled is not None and span.first_scheduled > span.arrival:
        ax.broken_barh(
            [(span.arrival - t0, span.first_scheduled - span.arrival)],
            (y - 0.2, 0.4),
            color=COLORS["wait"],
        )
    for kind in ("prefill", "decode", "idle"):
        bars = [(a - t0, b - a) for a, b in getattr(span, kind)]
        if bars:
            ax.broken_barh(
                bars,
                (y - 0.4, 0.8),
                color=COLORS[kind],
                hatch="//" if kind == "idle" else None,
                linewidth=0,
            )


def mark_missed(ax: plt.Axes, spans: Sequence[RequestSpans], missed: Collection[str],
                t0: float) -> int:  # fmt: skip
    """On a timeline whose rows are `spans` (top first, labelled): a red x where each missed
    request's last step ended, and its label in red. Returns the rows marked."""
    n, marked = len(spans), 0
    for row, (span, label) in enumerate(zip(spans, ax.get_yticklabels()[::-1], strict=True)):
        if span.rid not in missed:
            continue
        ends = [b for _, b in span.prefill + span.decode] or [span.first_scheduled or t0]
        ax.plot(max(ends) - t0, n - 1 - row, "x", color=MISSED_COLOR, markersize=5)
        label.set_color(MISSED_COLOR)
        marked += 1
    return marked


def _draw_batch(ax: plt.Axes, steps: Sequence[StepEntry], t0: float) -> None:
    """Batch size (sequences per step, slots held) on the left axis; waiting requests on the
    right one, since a queue can be many times the batch."""
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("batch")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not steps:
        return
    times = [s.t_plan - t0 for s in steps] + [steps[-1].t_result - t0]
    seqs = [s.num_seqs for s in steps] + [steps[-1].num_seqs]
    ax.step(times, seqs, where="post", color=COLORS["decode"], label="sequences in the step")
    if any(s.num_running != s.num_seqs for s in steps):
        held = [s.num_running for s in steps] + [steps[-1].num_running]
        ax.step(times, held, where="post", color="k", ls=":", label="slots held")
    ax.set_ylim(bottom=0)
    lines, labels = ax.get_legend_handles_labels()
    if all(s.num_waiting is not None for s in steps):
        ax_w = ax.twinx()
        waiting = [s.num_waiting for s in steps] + [steps[-1].num_waiting]
        ax_w.step(times, waiting, where="post", color="#e15759", alpha=0.7, label="waiting")
        ax_w.set_ylabel("waiting", color="#e15759")
        ax_w.set_ylim(bottom=0)
        ax_w.yaxis.set_major_locator(MaxNLocator(integer=True))
        more_lines, more_labels = ax_w.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    ax.legend(
        lines, labels, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8, frameon=False
    )


def _short(rid: str) -> str:
    return rid if len(rid) <= 14 else "…" + rid[-13:]


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
