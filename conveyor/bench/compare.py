"""`conveyor bench --compare FIELD=A,B,...`: one engine setting, several values, one workload.

For each value it starts an engine (`conveyor.launcher.LocalStack`: same model, worker, seed;
only FIELD differs, FIELD being any `conveyor up` flag, docs/cli.md), runs the same workload
against it (the workload and arrival flags of a plain run, or the named `--scenarios`), reads
the scheduler's step log, draws each run's timeline, and stops the engine. One table: TTFT
p50/p99, TPOT p50/p99, ITL p99 and max, output tok/s, steps, each value's throughput against
the first one's; `steps-<scenario>.png` puts every run's steps one above the other.

`--compare-batching` is `--compare batching=static,dynamic,continuous` (`--modes`) over the
batching scenarios (uniform lengths, mixed lengths 32-512 in / 16-256 out, high concurrency),
with `max_num_seqs` = `batch_size` = B in every mode, and the batching table's extra columns:
slot utilization and the analytical prediction (analytical.py) beside the measured ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.analytical import predict
from conveyor.bench.backends import ConveyorBackend
from conveyor.bench.compare_plan import Comparison, Scenario, comparison_from_args, pairs
from conveyor.bench.goodput import class_targets, with_classes
from conveyor.bench.metrics import compute_metrics, missed_targets, parse_goodput
from conveyor.bench.plots import plot_latency_cdfs, plot_step_strips, plot_timeline
from conveyor.bench.report import ProgressBar, format_table, write_json
from conveyor.bench.runner import RunOutcome, run_workload
from conveyor.bench.spec_figures import drafts, predicted_columns, spec_counters
from conveyor.bench.steplog import (
    StepEntry,
    engine_rids,
    engine_view,
    read_rid_map,
    read_step_log,
    step_summary,
    useful_slot_fraction,
)
from conveyor.bench.workloads import generate
from conveyor.launcher import LocalStack, StackSettings
from shared.client import Client
from shared.config_flags import parse_config


def stack_settings(
    args: argparse.Namespace, comparison: Comparison, value: str, log_dir: Path
) -> StackSettings:
    """One engine of the comparison: only the compared field differs between them. The
    --engine-flag and --worker-flag NAME=VALUE pairs are `conveyor up` flags (docs/cli.md)."""
    flags: dict[str, Any] = {
        "batch_timeout": args.batch_timeout,
        "model": args.model,
        "worker": args.worker,
        "sim_device": args.sim_device,
        "sim_model": args.sim_model,
    }
    if comparison.batch_size is not None:
        flags.update(max_num_seqs=comparison.batch_size, batch_size=comparison.batch_size)
    given = {**pairs(args.engine_flag, "--engine-flag"),
             **pairs(args.worker_flag, "--worker-flag")}  # fmt: skip
    if comparison.field in given:
        raise ValueError(f"--compare {comparison.field}: also given as an --engine-flag")
    flags.update(given)
    flags[comparison.field] = value
    argv = [text for name, value in flags.items() if value is not None
            for text in ("--" + name.replace("_", "-"), str(value))]  # fmt: skip
    settings = parse_config(StackSettings, argv)
    return replace(settings, frontend_address=f"tcp://127.0.0.1:{_free_port()}", gateway=False,
                   log_dir=log_dir)  # fmt: skip


def fit_to_engine(plan: list[Scenario], address: str) -> list[Scenario]:
    """Clip prompts to the engine's max_model_len (the same for every value: same worker)."""
    with Client(address, timeout=30.0) as client:
        limit = client.health().get("max_model_len")
    if not isinstance(limit, int):
        return plan
    return [replace(s, workload=replace(s.workload, max_model_len=limit)) for s in plan]


def run_compare(args: argparse.Namespace, command: str, flags_scenario: Scenario) -> int:
    """Every value x scenario; prints the table, writes compare.json/compare.md and PNGs."""
    if args.backend != "conveyor":
        raise ValueError("--compare starts Conveyor engines; --backend must be conveyor")
    comparison = comparison_from_args(args, flags_scenario)
    field, plan = comparison.field, comparison.scenarios
    for value in comparison.values:  # a bad field or value fails before any engine starts
        stack_settings(args, comparison, value, args.out)
    runs: dict[str, dict[str, dict[str, Any]]] = {s.name: {} for s in plan}
    traces: dict[str, dict[str, Any]] = {s.name: {} for s in plan}
    steps: dict[str, dict[str, Any]] = {s.name: {} for s in plan}
    for value in comparison.values:
        log_dir = args.out / "logs" / value
        for old_log in log_dir.glob("*.log"):  # a previous comparison's: start afresh
            old_log.unlink()
        print(f"=== engine: {field}={value}, worker={args.worker}", file=sys.stderr)
        stack = LocalStack(stack_settings(args, comparison, value, log_dir)).start()
        try:
            stack.wait_ready(timeout=args.engine_timeout)
            plan = fit_to_engine(plan, stack.frontend_address)
            for i, sc in enumerate(plan):
                before = spec_counters(stack.frontend_address)
                outcome = _run_scenario(args, stack.frontend_address, sc, value, warmup=i == 0)
                measured, run_steps = _measure(args, outcome, log_dir, sc, comparison, value)
                measured.update(drafts(before, spec_counters(stack.frontend_address)))
                runs[sc.name][value], traces[sc.name][value] = measured, outcome.traces
                steps[sc.name][value] = run_steps
        finally:
            stack.stop()
    rows = comparison_rows(comparison, runs)
    headers = list(rows[0].keys())
    print(format_table(headers, [list(r.values()) for r in rows]))
    figures = {} if args.no_plots else _figures(args.out, field, traces, steps)
    report = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "config": _config(args, comparison),
        "table": rows,
        "runs": runs,
        "figures": figures,
    }
    write_json(args.out / "compare.json", report)
    (args.out / "compare.md").write_text(_markdown(command, headers, rows))
    print(f"results: {args.out / 'compare.json'}, {args.out / 'compare.md'}")
    # refusals asked for (--goodput classes: slo_unattainable; a bounded queue: overloaded)
    # are misses in the goodput, not a failed comparison
    failed = sum(r["failed"] - (r.get("num_refused") or 0)
                 for by_value in runs.values() for r in by_value.values())  # fmt: skip
    return 0 if failed == 0 else 1


def _run_scenario(
    args: argparse.Namespace, address: str, sc: Scenario, value: str, warmup: bool
) -> RunOutcome:
    _, classes = parse_goodput(args.goodput)
    requests = with_classes(generate(sc.workload), classes)
    arrivals = sc.arrivals
    if warmup:  # an engine's first requests pay one-off costs: one uncounted request first
        arrivals = replace(arrivals, num_warmups=max(1, arrivals.num_warmups))
    progress = None if args.no_progress else ProgressBar(len(requests), f"{value:>14} {sc.name}")

    async def go() -> RunOutcome:
        targets = class_targets(classes, args.on_slo_miss)
        backend = ConveyorBackend(address, id_prefix=f"{value}-{sc.name}", targets=targets)
        try:
            return await run_workload(backend, requests, arrivals, sc.sampling, progress)
        finally:
            await backend.aclose()

    return asyncio.run(go())


def _measure(
    args: argparse.Namespace, outcome: RunOutcome, log_dir: Path, sc: Scenario,
    comparison: Comparison, value: str,
) -> tuple[dict[str, Any], list[StepEntry]]:  # fmt: skip
    """Metrics + what the step log says (step time, utilization) + the timeline picture; and
    the run's steps."""
    slos, classes = parse_goodput(args.goodput)
    metrics = compute_metrics(outcome.traces, outcome.duration_s, slos=slos, classes=classes)
    result: dict[str, Any] = dict(metrics)
    steps = read_step_log(log_dir / "scheduler.log", outcome.start_wall, outcome.end_wall)
    arrivals, lens = engine_view(steps, outcome.traces, read_rid_map(log_dir))
    result.update(step_summary(steps))
    if comparison.batch_size is not None:
        slots = comparison.batch_size
        result["useful_slot_fraction"] = useful_slot_fraction(steps, lens, slots)
    if steps and not args.no_plots:
        path = args.out / f"timeline-{sc.name}-{value}.png"
        title = f"{sc.name}, {comparison.field}={value}"
        result["timeline"] = str(path)
        missed = missed_targets(outcome.traces, slos, classes)
        rids = engine_rids(steps, outcome.traces, read_rid_map(log_dir))
        marked = {e for e, c in rids.items() if c in missed}
        result["timeline_rows"] = plot_timeline(steps, arrivals, path, lens, title, marked)
    return result, steps


def comparison_rows(
    comparison: Comparison, runs: dict[str, dict[str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The table: one row per scenario x value, throughput against the first value's."""
    rows = []
    first = comparison.values[0]
    for sc in comparison.scenarios:
        by_value = runs[sc.name]
        base = by_value.get(first)
        for value, r in by_value.items():
            row = {
                "scenario": sc.name,
                comparison.field: value,
                "done": r["completed"],
                "out tok/s": r["output_throughput"],
                "TTFT p50 s": r["median_ttft_ms"] / 1000.0,
                "TTFT p99 s": r["p99_ttft_ms"] / 1000.0,
                "TPOT p50 ms": r["median_tpot_ms"],
                "TPOT p99 ms": r["p99_tpot_ms"],
                "ITL p99 ms": r["p99_itl_ms"],
                "ITL max ms": r["max_itl_ms"],
                "steps": r["num_steps"],
                "step ms": r["mean_step_ms"],
                f"x {first}": _ratio(r, base),
            }
            if any("spec_draft_tokens" in v for b in runs.values() for v in b.values()):
                share = r.get("spec_accepted_share")  # speculation: drafts accepted
                row["drafts acc %"] = None if share is None else 100.0 * share
                row.update(predicted_columns(r, base))
            if r.get("request_goodput") is not None:  # --goodput: refusals count as misses
                row.update(_goodput_columns(r, base))
            if comparison.field == "batching" and comparison.batch_size is not None:
                static = by_value.get("static")
                row.update(_batching_columns(sc, value, r, static, comparison.batch_size))
            rows.append(row)
    return rows


def _batching_columns(
    sc: Scenario, mode: str, r: dict[str, Any], static: Optional[dict[str, Any]], batch_size: int
) -> dict[str, Any]:
    """Slot utilization, and on the continuous row the analytical model's ratio for the
    workload's output lengths (exact: EOS is ignored) with each mode's measured step time."""
    out: dict[str, Any] = {
        "batch util": r["mean_batch_utilization"],
        "useful util": r.get("useful_slot_fraction"),
        "model x": None,
        "packing x": None,
    }
    if mode != "continuous" or static is None:
        return out
    t_static, t_cont = static.get("mean_step_ms"), r.get("mean_step_ms")
    if t_static and t_cont:
        lens = [req.max_tokens for req in generate(sc.workload)]
        p = predict(lens, batch_size, t_static / 1000.0, t_cont / 1000.0)
        out.update({"model x": p.ratio_queue_limited, "packing x": p.ratio_packing})
    return out


def _goodput_columns(r: dict[str, Any], base: Optional[dict[str, Any]]) -> dict[str, Any]:
    base_goodput = None if base is None else base.get("request_goodput")
    met = r.get("met_share_of_admitted")
    return {
        "goodput req/s": r["request_goodput"],
        "goodput x": r["request_goodput"] / base_goodput if base_goodput else None,
        "refused": r.get("num_refused"),
        "refusal max ms": r.get("max_refusal_ms"),
        "failed": r["failed"],
        "met % admitted": None if met is None else 100.0 * met,
    }


def _ratio(r: dict[str, Any], base: Optional[dict[str, Any]]) -> Optional[float]:
    if base is None or not base["output_throughput"]:
        return None
    return r["output_throughput"] / base["output_throughput"]


def _figures(
    out: Path, field: str, traces: dict[str, dict[str, Any]], steps: dict[str, dict[str, Any]]
) -> dict[str, str]:
    figures = {}
    for name, by_value in traces.items():
        figures[f"cdf_{name}"] = str(plot_latency_cdfs(by_value, out / f"cdf-{name}.png"))
        title = f"{name}: each run's steps, {field}"
        path = plot_step_strips(steps[name], out / f"steps-{name}.png", title)
        figures[f"steps_{name}"] = str(path)
    return figures


def _config(args: argparse.Namespace, comparison: Comparison) -> dict[str, Any]:
    return {
        "field": comparison.field,
        "values": comparison.values,
        "batch_size": comparison.batch_size,
        "batch_timeout": args.batch_timeout,
        "model": args.model,
        "worker": args.worker,
        "sim_device": args.sim_device,
        "sim_model": args.sim_model,
        "engine_flags": args.engine_flag,
        "worker_flags": args.worker_flag,
        "seed": args.seed,
        "scenarios": {
            s.name: {
                "workload": s.workload.name,
                "num_prompts": s.workload.num_prompts,
                "scale": s.workload.scale,
                "request_rate": str(s.arrivals.request_rate),
            }
            for s in comparison.scenarios
        },
    }


def _markdown(command: str, headers: list[str], rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [f"`{command}`", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r.values()) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
