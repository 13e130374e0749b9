"""`conveyor sim ...`: the simulated worker's tools (docs/simulator.md).

    conveyor sim measure   -o timings.json     time the REAL worker's steps on this machine
    conveyor sim calibrate timings.json -o profile.json   fit a device profile to them
    conveyor sim predict   --sim-device h200 --sim-model llama-3-8b   modelled step times

`measure` loads the real model and runs it at full speed: run it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from services.worker.sim.calibrate import TIMINGS_FORMAT, FitResult, fit_profile, load_timings
from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.measure import MeasureGrid, collect_timings
from services.worker.sim.profiles import DEVICES, MODELS, get_device

MAX_ERROR = 0.15  # the bar: simulated within 15% of measured


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 1,2,4") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("every value must be a positive integer")
    return values


def _pairs(text: str) -> list[tuple[int, int]]:
    """'8:128,16:256' -> [(8, 128), (16, 256)]; '' -> []."""
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 8:128,16:256") from None
    if any(len(p) != 2 or min(p) <= 0 for p in pairs):
        raise argparse.ArgumentTypeError("each pair is DECODES:CHUNK, both > 0")
    return [(p[0], p[1]) for p in pairs]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="sim_command", required=True)
    m = sub.add_parser("measure", help="time the real worker's steps (loads the model)")
    m.add_argument("-o", "--out", type=Path, default=Path("results/sim/timings.json"))
    m.add_argument("--model", default=None, help="real model spec (default smollm2)")
    m.add_argument(
        "--sim-model",
        default="smollm2-135m",
        choices=sorted(MODELS),
        help="the model shape the timings are fitted with",
    )
    m.add_argument("--dtype", default=None, help="worker dtype (default: the worker's)")
    m.add_argument("--num-threads", type=int, default=None)
    m.add_argument("--batch-sizes", type=_ints, default=_ints("1,2,4,8,16,32"))
    m.add_argument(
        "--context-lens",
        type=_ints,
        default=_ints("128,512"),
        help="cached tokens per sequence for the decode samples",
    )
    m.add_argument("--prefill-lens", type=_ints, default=_ints("16,64,128,256,512"))
    m.add_argument(
        "--prefill-batch",
        type=int,
        default=4,
        help="also time prefills of this many prompts at once",
    )
    m.add_argument(
        "--mixed",
        type=_pairs,
        default=_pairs("8:128,16:256"),
        help="DECODES:CHUNK pairs: a prompt chunk prefilled beside running decodes",
    )
    m.add_argument("--repeats", type=int, default=3, help="timed steps per shape in a row")
    m.add_argument(
        "--rounds", type=int, default=3, help="passes over all shapes (times are pooled)"
    )
    m.set_defaults(func=cmd_measure)
    c = sub.add_parser("calibrate", help="fit a device profile to measured timings")
    c.add_argument("timings", type=Path)
    c.add_argument("-o", "--out", type=Path, required=True)
    c.add_argument("--name", default="cpu-smollm2-calibrated")
    c.add_argument(
        "--base-device",
        default="cpu-smollm2",
        choices=sorted(DEVICES),
        help="where the memory size comes from",
    )
    c.add_argument(
        "--max-error",
        type=float,
        default=MAX_ERROR,
        help="exit 1 when a sample's relative error exceeds this",
    )
    c.set_defaults(func=cmd_calibrate)
    r = sub.add_parser("predict", help="print modelled step times")
    r.add_argument("--sim-device", default="h200", choices=sorted(DEVICES))
    r.add_argument("--sim-profile", type=Path, default=None)
    r.add_argument("--sim-model", default="llama-3-8b", choices=sorted(MODELS))
    r.add_argument("--batch-sizes", type=_ints, default=_ints("1,8,32,64,128,256"))
    r.add_argument("--context-len", type=int, default=512)
    r.add_argument("--prefill-lens", type=_ints, default=_ints("128,512,2048"))
    r.add_argument("--sim-weight-dtype", default="bfloat16", choices=("bfloat16", "float8"))
    r.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N devices in one tensor-parallel group (all-reduce term)")  # fmt: skip
    r.set_defaults(func=cmd_predict)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad files or configs: one clear line, not a traceback
        print(f"conveyor sim: {exc}", file=sys.stderr)
        return 2


# ---- predict -----------------------------------------------------------------------------------


def cmd_predict(args: argparse.Namespace) -> int:
    config = SimConfig(device=args.sim_device, model=args.sim_model,
                       profile_path=args.sim_profile, weight_dtype=args.sim_weight_dtype,
                       tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    device, model = config.device_profile(), config.model_shape()
    print(f"SIMULATED step times: {model.name} on {device.name} ({device.source})")
    print(f"{'step':<28}{'ms':>10}{'bound':>10}{'tok/s':>12}{'comm ms':>10}")
    ctx = args.context_len
    for b in args.batch_sizes:
        cost = step_cost(device, step_work(model, [ctx] * b, [1] * b, b))
        _row(f"decode B={b} ctx={ctx}", cost.total_s, cost.bound, b, cost.comm_s)
    for n in args.prefill_lens:
        cost = step_cost(device, step_work(model, [0], [n], 1))
        _row(f"prefill {n} tokens", cost.total_s, cost.bound, n, cost.comm_s)
    return 0


def _row(label: str, seconds: float, bound: str, tokens: int, comm_s: float) -> None:
    rate = f"{tokens / seconds:12.0f}" if seconds > 0 else f"{'inf':>12}"
    print(f"{label:<28}{1e3 * seconds:10.3f}{bound:>10}{rate}{1e3 * comm_s:10.3f}")


# ---- calibrate ---------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    model, timings = load_timings(args.timings)
    source = f"calibrated by `conveyor sim calibrate` from {args.timings} ({len(timings)} steps)"
    result = fit_profile(model, timings, get_device(args.base_device), args.name, source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.profile.to_json())
    _print_fit(result, timings_shapes(timings))
    print(f"wrote {args.out}; use it with --sim-profile {args.out}")
    if result.max_abs_error > args.max_error:
        print(f"max error {result.max_abs_error:.1%} exceeds {args.max_error:.0%}", file=sys.stderr)
        return 1
    return 0


def timings_shapes(timings: list[Any]) -> list[str]:
    """A short label per sample: B sequences, tokens computed, mean cached context."""
    labels = []
    for t in timings:
        b, n = len(t.num_tokens), sum(t.num_tokens)
        ctx = sum(t.start_positions) // b
        labels.append(f"B={b} tokens={n} ctx={ctx}")
    return labels


def _print_fit(result: FitResult, labels: list[str]) -> None:
    p = result.profile
    print("fitted profile (SIMULATED device):")
    keys = ("dense_flops", "attention_flops", "bandwidth", "kv_bandwidth", "pack_bandwidth",
            "launch_s", "per_seq_s", "prefill_step_s")  # fmt: skip
    for key in keys:
        print(f"  {key:<16} {getattr(p, key)}")
    print(f"{'sample':<34}{'measured ms':>12}{'model ms':>10}{'error':>8}")
    for label, m, pr, e in zip(
        labels, result.measured, result.predicted, result.relative_errors, strict=True
    ):
        print(f"{label:<34}{1e3 * m:12.2f}{1e3 * pr:10.2f}{e:8.1%}")
    print(f"max |error| {result.max_abs_error:.1%}")


# ---- measure -----------------------------------------------------------------------------------


def cmd_measure(args: argparse.Namespace) -> int:
    """Time the real worker (services.worker.runner.ModelRunner) across the grid's shapes."""
    # The worker (torch, the model) is imported only here: predict and calibrate stay light.
    from services.worker.config import WorkerConfig
    from services.worker.runner import ModelRunner

    grid = MeasureGrid(
        batch_sizes=tuple(args.batch_sizes),
        context_lens=tuple(args.context_lens),
        prefill_lens=tuple(args.prefill_lens),
        prefill_batch=args.prefill_batch,
        mixed=tuple(args.mixed),
        repeats=args.repeats,
        rounds=args.rounds,
    )
    kwargs: dict[str, Any] = {"model": args.model, "num_threads": args.num_threads}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    config = WorkerConfig(**kwargs)
    runner = ModelRunner(config)
    samples = collect_timings(runner, grid, lambda text: print("measured", text, flush=True))
    out = {
        "format": TIMINGS_FORMAT,
        "model": args.sim_model,
        "worker": {
            "model": str(runner.folder),
            "dtype": config.dtype,
            "device": config.device,
            "num_threads": args.num_threads,
        },
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({len(samples)} samples)")
    return 0
