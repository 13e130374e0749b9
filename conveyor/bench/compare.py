"""`conveyor bench --compare-batching`: static vs dynamic vs continuous, measured on Conveyor.

For each batching mode it starts an engine (`conveyor.launcher.LocalStack`: same model, worker,
seed; `max_num_seqs` = `batch_size` = B so every mode has the same slots), runs each scenario's
workload as a burst with EOS ignored (exact output lengths), reads the scheduler's step log, and
stops the engine. Scenarios: uniform lengths, mixed lengths (32-512 in / 16-256 out),
high concurrency (mixed, `--high-concurrency-factor` times as many requests). Then it prints and
saves the table with the analytical prediction (analytical.py) beside the measured ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.analytical import predict
from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import ConveyorBackend, SamplingChoice
from conveyor.bench.metrics import compute_metrics
from conveyor.bench.plots import plot_latency_cdfs, plot_timeline
from conveyor.bench.report import ProgressBar, format_table, write_json
from conveyor.bench.runner import RunOutcome, run_workload
from conveyor.bench.steplog import (
    engine_view,
    read_rid_map,
    read_step_log,
    step_summary,
    useful_slot_fraction,
)
from conveyor.bench.workloads import WorkloadConfig, generate
from conveyor.launcher import LocalStack, StackSettings
from shared.client import Client
from shared.config_flags import parse_config

MODES = ("static", "dynamic", "continuous")
SCENARIOS = ("uniform", "mixed", "high-concurrency", "chat")
DEFAULT_SCENARIOS = SCENARIOS[:3]  # `chat` (heavy-tailed) only on request
# Defaults sized to finish in ~10 minutes on 2 CPU cores with SmolLM2 (see docs/bench.md).
DEFAULT_NUM_PROMPTS = 32
DEFAULT_SCALE = 0.5


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--compare-batching (starts its own engines)")
    g.add_argument("--compare-batching", action="store_true")
    g.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="B: static/dynamic batch size and continuous max_num_seqs",
    )
    # Long enough that a burst is all queued before static/dynamic form their first batch (the
    # frontend forwards requests one by one); only a last, partial batch ever waits for it.
    g.add_argument("--batch-timeout", type=float, default=0.5)
    g.add_argument(
        "--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"from {', '.join(SCENARIOS)}"
    )
    g.add_argument("--modes", default=",".join(MODES))
    g.add_argument("--high-concurrency-factor", type=int, default=4)
    g.add_argument("--worker", choices=("model", "sim"), default="model")
    g.add_argument("--sim-device", default=None, help="with --worker sim, e.g. h200")
    g.add_argument("--sim-model", default=None, help="with --worker sim, e.g. llama-3-8b")
    g.add_argument(
        "--engine-flag",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra scheduler flag, e.g. max_num_batched_tokens=512",
    )
    g.add_argument("--worker-flag", action="append", default=[], metavar="NAME=VALUE")
    g.add_argument("--engine-timeout", type=float, default=600.0, help="s to wait for ready")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    workload: WorkloadConfig


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The workloads, sized by --num-prompts and --scale (compare defaults: 32 and 0.5)."""
    n = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    scale = DEFAULT_SCALE if args.scale is None else args.scale
    common = {"seed": args.seed, "scale": scale}
    table = {
        "uniform": WorkloadConfig(
            name="uniform", num_prompts=n, input_len=256, output_len=128, **common
        ),
        "mixed": WorkloadConfig(name="mixed", num_prompts=n, **common),
        "chat": WorkloadConfig(name="chat", num_prompts=n, **common),
        "high-concurrency": WorkloadConfig(
            name="mixed", num_prompts=n * args.high_concurrency_factor, **common
        ),
    }
    names = _list(args.scenarios, SCENARIOS, "--scenarios")
    return [Scenario(name, table[name]) for name in names]


def stack_settings(args: argparse.Namespace, mode: str, log_dir: Path) -> StackSettings:
    """One engine of the comparison: only `batching` differs between modes. The
    --engine-flag and --worker-flag NAME=VALUE pairs are `conveyor up` flags (docs/cli.md)."""
    flags: dict[str, Any] = {
        "batching": mode,
        "max_num_seqs": args.batch_size,
        "batch_size": args.batch_size,
        "batch_timeout": args.batch_timeout,
        "model": args.model,
        "worker": args.worker,
        "sim_device": args.sim_device,
        "sim_model": args.sim_model,
    }
    flags.update(_pairs(args.engine_flag, "--engine-flag"))
    flags.update(_pairs(args.worker_flag, "--worker-flag"))
    argv = [text for name, value in flags.items() if value is not None
            for text in ("--" + name.replace("_", "-"), str(value))]  # fmt: skip
    settings = parse_config(StackSettings, argv)
    return replace(settings, frontend_address=f"tcp://127.0.0.1:{_free_port()}", gateway=False,
                   log_dir=log_dir)  # fmt: skip


def fit_to_engine(plan: list[Scenario], address: str) -> list[Scenario]:
    """Clip prompts to the engine's max_model_len (the same for every mode: same worker)."""
    with Client(address, timeout=30.0) as client:
        limit = client.health().get("max_model_len")
    if not isinstance(limit, int):
        return plan
    return [Scenario(s.name, replace(s.workload, max_model_len=limit)) for s in plan]


def run_compare(args: argparse.Namespace, command: str) -> int:
    """Every mode x scenario; prints the table, writes compare.json/compare.md and PNGs."""
    if args.backend != "conveyor":
        raise ValueError("--compare-batching starts Conveyor engines; --backend must be conveyor")
    modes = _list(args.modes, MODES, "--modes")
    plan = scenarios(args)
    runs: dict[str, dict[str, dict[str, Any]]] = {s.name: {} for s in plan}
    traces: dict[str, dict[str, Any]] = {s.name: {} for s in plan}
    for mode in modes:
        log_dir = args.out / "logs" / mode
        for old_log in log_dir.glob("*.log"):  # a previous comparison's: start afresh
            old_log.unlink()
        print(
            f"=== engine: batching={mode}, B={args.batch_size}, worker={args.worker}",
            file=sys.stderr,
        )
        stack = LocalStack(stack_settings(args, mode, log_dir)).start()
        try:
            stack.wait_ready(timeout=args.engine_timeout)
            plan = fit_to_engine(plan, stack.frontend_address)
            for i, sc in enumerate(plan):
                outcome = _run_scenario(args, stack.frontend_address, sc, mode, warmup=i == 0)
                runs[sc.name][mode] = _measure(args, outcome, log_dir, sc, mode)
                traces[sc.name][mode] = outcome.traces
        finally:
            stack.stop()
    rows = comparison_rows(plan, runs, args.batch_size)
    headers = list(rows[0].keys())
    print(format_table(headers, [list(r.values()) for r in rows]))
    figures = {} if args.no_plots else _cdfs(args.out, traces)
    report = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "config": _config(args, plan),
        "table": rows,
        "runs": runs,
        "figures": figures,
    }
    write_json(args.out / "compare.json", report)
    (args.out / "compare.md").write_text(_markdown(command, headers, rows))
    print(f"results: {args.out / 'compare.json'}, {args.out / 'compare.md'}")
    failed = sum(r["failed"] for by_mode in runs.values() for r in by_mode.values())
    return 0 if failed == 0 else 1


def _run_scenario(
    args: argparse.Namespace, address: str, sc: Scenario, mode: str, warmup: bool
) -> RunOutcome:
    requests = generate(sc.workload)
    arrivals = ArrivalConfig(num_warmups=1 if warmup else 0, seed=args.seed)
    sampling = SamplingChoice(temperature=0.0, ignore_eos=True)
    progress = None if args.no_progress else ProgressBar(len(requests), f"{mode:>10} {sc.name}")

    async def go() -> RunOutcome:
        backend = ConveyorBackend(address, id_prefix=f"{mode}-{sc.name}")
        try:
            return await run_workload(backend, requests, arrivals, sampling, progress)
        finally:
            await backend.aclose()

    return asyncio.run(go())


def _measure(
    args: argparse.Namespace, outcome: RunOutcome, log_dir: Path, sc: Scenario, mode: str
) -> dict[str, Any]:
    """Metrics + what the step log says (step time, utilization) + the timeline picture."""
    result: dict[str, Any] = dict(compute_metrics(outcome.traces, outcome.duration_s))
    steps = read_step_log(log_dir / "scheduler.log", outcome.start_wall, outcome.end_wall)
    arrivals, lens = engine_view(steps, outcome.traces, read_rid_map(log_dir))
    result.update(step_summary(steps))
    result["useful_slot_fraction"] = useful_slot_fraction(steps, lens, args.batch_size)
    if steps and not args.no_plots:
        path = args.out / f"timeline-{sc.name}-{mode}.png"
        title = f"{sc.name}, batching={mode}, B={args.batch_size}"
        result["timeline"] = str(path)
        result["timeline_rows"] = plot_timeline(steps, arrivals, path, lens, title=title)
    return result


def comparison_rows(
    plan: list[Scenario], runs: dict[str, dict[str, dict[str, Any]]], batch_size: int
) -> list[dict[str, Any]]:
    """The comparison table: one row per scenario x mode, ratios against static."""
    rows = []
    for sc in plan:
        by_mode = runs[sc.name]
        static = by_mode.get("static")
        for mode, r in by_mode.items():
            row = {
                "scenario": sc.name,
                "mode": mode,
                "done": r["completed"],
                "out tok/s": r["output_throughput"],
                "total tok/s": r["total_token_throughput"],
                "mean E2EL s": r["mean_e2el_ms"] / 1000.0,
                "p99 E2EL s": r["p99_e2el_ms"] / 1000.0,
                "mean TTFT s": r["mean_ttft_ms"] / 1000.0,
                "batch util": r["mean_batch_utilization"],
                "useful util": r["useful_slot_fraction"],
                "steps": r["num_steps"],
                "step ms": r["mean_step_ms"],
                "x static": _ratio(r, static),
                "model x": None,
                "packing x": None,
            }
            if mode == "continuous" and static is not None:
                lens = [req.max_tokens for req in generate(sc.workload)]
                row.update(_predicted(static, r, lens, batch_size))
            rows.append(row)
    return rows


def _predicted(
    static: dict[str, Any], cont: dict[str, Any], lens: list[int], batch_size: int
) -> dict[str, Any]:
    """The analytical model's ratio for the workload's output lengths (exact: EOS is ignored), with
    each mode's measured mean step time."""
    t_static, t_cont = static.get("mean_step_ms"), cont.get("mean_step_ms")
    if not t_static or not t_cont:
        return {}
    p = predict(lens, batch_size, t_static / 1000.0, t_cont / 1000.0)
    return {"model x": p.ratio_queue_limited, "packing x": p.ratio_packing}


def _ratio(r: dict[str, Any], static: Optional[dict[str, Any]]) -> Optional[float]:
    if static is None or not static["output_throughput"]:
        return None
    return r["output_throughput"] / static["output_throughput"]


def _cdfs(out: Path, traces: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {
        f"cdf_{name}": str(plot_latency_cdfs(by_mode, out / f"cdf-{name}.png"))
        for name, by_mode in traces.items()
    }


def _config(args: argparse.Namespace, plan: list[Scenario]) -> dict[str, Any]:
    return {
        "batch_size": args.batch_size,
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
            }
            for s in plan
        },
    }


def _markdown(command: str, headers: list[str], rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [f"`{command}`", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in r.values()) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _list(raw: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: choose from {', '.join(allowed)} (got {raw!r})")
    return items


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} {item!r}: use NAME=VALUE")
        out[name.strip().replace("-", "_")] = value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
