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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from services.worker.config import WorkerConfig
from services.worker.sim.calibrate import TIMINGS_FORMAT, FitResult, fit_profile, load_timings
from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.measure import MeasureGrid, collect_timings
from services.worker.sim.profiles import DEVICES, MODELS, get_device
from shared.config_flags import add_config_flags, build_config

MAX_ERROR = 0.15  # the bar: simulated within 15% of measured
# What `predict` models (the rest of SimConfig is the serving worker's).
PREDICTED = ("device", "model", "profile_path", "weight_dtype", "tensor_parallel_size")


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    flag_env: ClassVar[bool] = False

    out: Path = field(
        default=Path("results/sim/timings.json"),
        metadata={"aliases": ("-o",), "help": "where the timings JSON goes"},
    )
    sim_model: str = field(
        default="smollm2-135m",
        metadata={"choices": tuple(sorted(MODELS)),
                  "help": "the model shape the timings are fitted with"},
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CalibrateOptions:
    flag_env: ClassVar[bool] = False

    out: Path = field(metadata={"aliases": ("-o",), "help": "where the profile JSON goes"})
    name: str = field(default="cpu-smollm2-calibrated", metadata={"help": "the profile's name"})
    base_device: str = field(
        default="cpu-smollm2",
        metadata={"choices": tuple(sorted(DEVICES)), "help": "where the memory size comes from"},
    )
    max_error: float = field(
        default=MAX_ERROR,
        metadata={"help": "exit 1 when a sample's relative error exceeds this"},
    )


@dataclass(frozen=True, slots=True)
class PredictOptions:
    flag_env: ClassVar[bool] = False

    batch_sizes: tuple[int, ...] = field(
        default=(1, 8, 32, 64, 128, 256), metadata={"help": "sequences of the decode steps"}
    )
    context_len: int = field(
        default=512, metadata={"help": "cached tokens per sequence of the decode steps"}
    )
    prefill_lens: tuple[int, ...] = field(
        default=(128, 512, 2048), metadata={"help": "prompt lengths of the prefill steps"}
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="sim_command", required=True)
    m = sub.add_parser("measure", help="time the real worker's steps (loads the model)")
    for cls in (MeasureOptions, MeasureGrid, WorkerConfig):
        add_config_flags(m, cls)
    m.set_defaults(func=cmd_measure)
    c = sub.add_parser("calibrate", help="fit a device profile to measured timings")
    c.add_argument("timings", type=Path, help="the file of `conveyor sim measure`")
    add_config_flags(c, CalibrateOptions)
    c.set_defaults(func=cmd_calibrate)
    r = sub.add_parser("predict", help="print modelled step times")
    add_config_flags(r, SimConfig, only=PREDICTED)
    add_config_flags(r, PredictOptions)
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
    config = build_config(SimConfig, args, only=PREDICTED)
    options = build_config(PredictOptions, args)
    device, model = config.device_profile(), config.model_shape()
    print(f"SIMULATED step times: {model.name} on {device.name} ({device.source})")
    print(f"{'step':<28}{'ms':>10}{'bound':>10}{'tok/s':>12}{'comm ms':>10}")
    ctx = options.context_len
    for b in options.batch_sizes:
        cost = step_cost(device, step_work(model, [ctx] * b, [1] * b, b))
        _row(f"decode B={b} ctx={ctx}", cost.total_s, cost.bound, b, cost.comm_s)
    for n in options.prefill_lens:
        cost = step_cost(device, step_work(model, [0], [n], 1))
        _row(f"prefill {n} tokens", cost.total_s, cost.bound, n, cost.comm_s)
    return 0


def _row(label: str, seconds: float, bound: str, tokens: int, comm_s: float) -> None:
    rate = f"{tokens / seconds:12.0f}" if seconds > 0 else f"{'inf':>12}"
    print(f"{label:<28}{1e3 * seconds:10.3f}{bound:>10}{rate}{1e3 * comm_s:10.3f}")


# ---- calibrate ---------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    options = build_config(CalibrateOptions, args)
    model, timings = load_timings(args.timings)
    source = f"calibrated by `conveyor sim calibrate` from {args.timings} ({len(timings)} steps)"
    result = fit_profile(model, timings, get_device(options.base_device), options.name, source)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(result.profile.to_json())
    _print_fit(result, timings_shapes(timings))
    print(f"wrote {options.out}; use it with --sim-profile {options.out}")
    if result.max_abs_error > options.max_error:
        print(f"max error {result.max_abs_error:.1%} exceeds {options.max_error:.0%}",
              file=sys.stderr)  # fmt: skip
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
    from services.worker.runner import ModelRunner

    options = build_config(MeasureOptions, args)
    grid = build_config(MeasureGrid, args)
    config = build_config(WorkerConfig, args)
    runner = ModelRunner(config)
    samples = collect_timings(runner, grid, lambda text: print("measured", text, flush=True))
    out = {
        "format": TIMINGS_FORMAT,
        "model": options.sim_model,
        "worker": {
            "model": str(runner.folder),
            "dtype": config.dtype,
            "device": config.device,
            "num_threads": config.num_threads,
        },
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "samples": samples,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {options.out} ({len(samples)} samples)")
    return 0
