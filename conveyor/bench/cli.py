"""`conveyor bench`: measure a running server, or compare engine settings on engines of its own.

    conveyor bench --workload mixed --num-prompts 200 --request-rate 4 --out results/run1
    conveyor bench --backend openai --base-url http://127.0.0.1:8000 --model smollm2 ...
    conveyor bench --sweep max-concurrency:1,4,16,64 --out results/sweep
    conveyor bench --compare step_composition=mixed,prefill-first,decode-first --out results/c
    conveyor bench --compare-batching --out results/bench      (both start their own engines)

Writes <out>/result.json (fields named as `vllm bench serve` names them, plus the command that
produced them) and PNGs: latency CDFs, the run's timeline (when the scheduler's step log is
readable), throughput/latency against the swept quantity.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import BACKENDS, SamplingChoice, make_backend
from conveyor.bench.compare_plan import Scenario, add_compare_flags
from conveyor.bench.goodput import class_targets, with_classes
from conveyor.bench.metrics import (
    compute_metrics,
    missed_targets,
    parse_goodput,
    per_request_fields,
)
from conveyor.bench.plots import plot_latency_cdfs, plot_sweep, plot_timeline
from conveyor.bench.report import ProgressBar, format_result, format_table, write_json
from conveyor.bench.runner import RunOutcome, run_workload
from conveyor.bench.steplog import engine_rids, engine_view, read_rid_map, read_step_log
from conveyor.bench.texts import TEXT_WORKLOADS, tokenizer_folder
from conveyor.bench.workloads import WORKLOADS, WorkloadConfig, generate
from shared.addresses import DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT, default_frontend_address
from shared.protocol.engine_channel import ON_SLO_MISS

SWEEPABLE = ("max-concurrency", "request-rate")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    _add_target_flags(p.add_argument_group("target"))
    _add_workload_flags(p.add_argument_group("workload"))
    _add_arrival_flags(p.add_argument_group("arrivals"))
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("results/bench"))
    o.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="ttft:MS",
        help="SLOs (ms): ttft:MS tpot:MS for every request, or classes NAME=ttft:MS,tpot:MS"
        "[,share:F] whose targets are sent with each request (refusals count as misses)",
    )
    o.add_argument("--on-slo-miss", choices=ON_SLO_MISS, default="reject",
                   help="what requests of --goodput classes ask when out of reach")  # fmt: skip
    o.add_argument("--percentiles", default="90,99")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    add_compare_flags(p)
    return p


def _add_target_flags(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--backend", choices=BACKENDS, default="conveyor")
    t.add_argument(
        "--address",
        default=default_frontend_address(),
        help="Conveyor frontend (CONVEYOR_FRONTEND_ADDR)",
    )
    t.add_argument(
        "--base-url",
        default=f"http://{DEFAULT_HTTP_HOST}:{DEFAULT_HTTP_PORT}",
        help="OpenAI-compatible server",
    )
    t.add_argument(
        "--model",
        default=None,
        help="model name (openai backend); model to load (--compare)",
    )
    t.add_argument(
        "--log-dir",
        type=Path,
        default=Path("logs"),
        help="the engine's log folder; its scheduler.log draws the timeline",
    )


def _add_workload_flags(w: argparse._ArgumentGroup) -> None:
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="default 100 (--scenarios of --compare: 32 per scenario)",
    )
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--range-ratio", type=float, default=0.0)
    w.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: its prefix; multi-turn: the system prompt")  # fmt: skip
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every length; default 1 (--scenarios of --compare: 0.5)",
    )
    w.add_argument(
        "--tokenizer",
        default=None,
        help="copy/edit/quote: the model (folder or .gguf) whose tokenizer makes the prompts; "
        "default --model, else the packaged SmolLM2",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ignore-eos", action="store_true", help="outputs exactly max_tokens long")
    w.add_argument("--temperature", type=float, default=0.0)


def _add_arrival_flags(a: argparse._ArgumentGroup) -> None:
    a.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = burst")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--num-warmups", type=int, default=0)
    a.add_argument(
        "--sweep",
        default=None,
        metavar="NAME:V1,V2,...",
        help=f"repeat the run for each value of one of: {', '.join(SWEEPABLE)}",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`conveyor bench ...`; returns the exit status (1 when any request failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = "conveyor bench " + shlex.join(argv)
    try:
        if args.compare_batching or args.compare is not None:
            from conveyor.bench.compare import run_compare  # it imports the launcher

            sampling = SamplingChoice(temperature=args.temperature, ignore_eos=args.ignore_eos)
            flags_run = Scenario(args.workload, workload_from_args(args),
                                 arrivals_from_args(args), sampling)  # fmt: skip
            return run_compare(args, command, flags_run)
        if args.sweep:
            return _run_sweep(args, command)
        result = run_once(args, command, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    return 0 if result["failed"] == 0 else 1


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        name=args.workload,
        num_prompts=100 if args.num_prompts is None else args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        scale=1.0 if args.scale is None else args.scale,
        tokenizer=tokenizer_folder(args.tokenizer or args.model)
        if args.workload in TEXT_WORKLOADS
        else None,
    )


def arrivals_from_args(args: argparse.Namespace) -> ArrivalConfig:
    return ArrivalConfig(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
    )


def percentiles_from_args(args: argparse.Namespace) -> list[float]:
    try:
        return [float(p) for p in args.percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles: {args.percentiles!r} is not a list of numbers") from None


def execute(
    args: argparse.Namespace, workload: WorkloadConfig, arrivals: ArrivalConfig, label: str
) -> RunOutcome:
    """Send the workload to the configured backend; a fresh client per run."""
    _, classes = parse_goodput(args.goodput)
    requests = with_classes(generate(workload), classes)
    sampling = SamplingChoice(temperature=args.temperature, ignore_eos=args.ignore_eos)
    progress = None if args.no_progress else ProgressBar(len(requests), label)

    async def go() -> RunOutcome:
        backend = make_backend(
            args.backend,
            address=args.address,
            base_url=args.base_url,
            model=args.model or "default",
            id_prefix=f"bench-{uuid.uuid4().hex[:8]}",
            targets=class_targets(classes, args.on_slo_miss),
        )
        try:
            return await run_workload(backend, requests, arrivals, sampling, progress)
        finally:
            await backend.aclose()

    return asyncio.run(go())


def run_once(args: argparse.Namespace, command: str, out: Path) -> dict[str, Any]:
    """One run: execute, compute, print, save JSON and pictures; returns the result map."""
    workload, arrivals = workload_from_args(args), arrivals_from_args(args)
    percentiles = percentiles_from_args(args)
    slos, classes = parse_goodput(args.goodput)
    outcome = execute(args, workload, arrivals, label=args.workload)
    metrics = compute_metrics(outcome.traces, outcome.duration_s, percentiles, slos, classes)
    print(format_result(metrics, percentiles))
    result: dict[str, Any] = {
        "command": command,
        "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime()),
        "backend": args.backend,
        "model_id": args.model,
        "workload": asdict(workload),
        "num_prompts": workload.num_prompts,
        "request_rate": _json_rate(arrivals.request_rate),
        "burstiness": arrivals.burstiness,
        "max_concurrency": arrivals.max_concurrency,
        "ignore_eos": args.ignore_eos,
        **metrics,
    }
    if not args.no_plots:
        result["figures"] = _pictures(args, outcome, out)
    result.update(per_request_fields(outcome.traces))
    write_json(out / "result.json", result)
    print(f"results: {out / 'result.json'}")
    return result


def _pictures(args: argparse.Namespace, outcome: RunOutcome, out: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "latency_cdf": str(plot_latency_cdfs({args.workload: outcome.traces}, out / "cdf.png"))
    }
    steps = read_step_log(args.log_dir / "scheduler.log", outcome.start_wall, outcome.end_wall)
    if steps:
        rid_map = read_rid_map(args.log_dir)
        arrivals, lens = engine_view(steps, outcome.traces, rid_map)
        missed = missed_targets(outcome.traces, *parse_goodput(args.goodput))
        marked = {e for e, c in engine_rids(steps, outcome.traces, rid_map).items() if c in missed}
        rows = plot_timeline(steps, arrivals, out / "timeline.png", lens, missed=marked)
        figures.update(timeline=str(out / "timeline.png"), timeline_rows=rows)
    else:
        print(
            f"no step log in {args.log_dir}/scheduler.log for this run: no timeline",
            file=sys.stderr,
        )
    return figures


def _run_sweep(args: argparse.Namespace, command: str) -> int:
    name, _, raw = args.sweep.partition(":")
    if name not in SWEEPABLE or not raw:
        raise ValueError(f"--sweep: use NAME:V1,V2 with NAME one of {', '.join(SWEEPABLE)}")
    values = [float(v) for v in raw.split(",")]
    results = []
    for value in values:
        if name == "max-concurrency":
            args.max_concurrency = int(value)
        else:
            args.request_rate = value
        print(f"--- {name} = {value:g}", file=sys.stderr)
        results.append(run_once(args, command, args.out / f"{name}-{value:g}"))
    headers = [
        name,
        "req/s",
        "out tok/s",
        "mean TTFT ms",
        "p99 TTFT ms",
        "mean TPOT ms",
        "mean E2EL ms",
        "failed",
    ]
    rows = [
        [
            v,
            r["request_throughput"],
            r["output_throughput"],
            r["mean_ttft_ms"],
            r["p99_ttft_ms"],
            r["mean_tpot_ms"],
            r["mean_e2el_ms"],
            r["failed"],
        ]
        for v, r in zip(values, results, strict=True)
    ]
    print(format_table(headers, rows))
    summary = {
        "command": command,
        "sweep": name,
        "values": values,
        "results": [_scalars(r) for r in results],
    }
    if not args.no_plots:
        summary["figure"] = str(plot_sweep(values, results, name, args.out / "sweep.png"))
    write_json(args.out / "sweep.json", summary)
    return 0 if all(r["failed"] == 0 for r in results) else 1


def _scalars(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if not isinstance(v, list)}


def _json_rate(rate: float) -> Any:
    return "inf" if math.isinf(rate) else rate


if __name__ == "__main__":
    sys.exit(main())
