"""The engine's own overhead per step, measured with the zero-cost SIMULATED worker.

    PYTHONPATH=. .venv/bin/python bench/sim_overhead.py --running 64,256,1024
    PYTHONPATH=. .venv/bin/python bench/sim_overhead.py --running 256 --sim-device h200

`--async-scheduling off,on` (the default) runs each N with the scheduler's overlap off and on,
one after the other, so the two are compared side by side in one run. For every run it also
reports the device-only bound: the output tokens over the sum of the worker's step times
(`forward_s`: the modelled device time, ~0 with `--sim-device none`), against the engine's own
span (first plan sent to last result received).

For each N it starts a stack (tokenizer + scheduler + `--sim-device none` worker), submits N
requests with short prompts and long outputs so that N decodes run together for hundreds of
steps, and reads the worker's `sim_engine_gap` log lines: its idle gap between steps, the time
from one step's result to the next plan (result transport, scheduler update, next schedule,
plan transport; outputs are routed to the tokenizer after the plan has left), and its own
execute time per step (`exec us`); and the scheduler's step log: its own side of that gap
(result frame in -> plan frame out). `period us` is the pipeline's step time (the engine's span
per step). With a zero-cost device the worker's gap is the whole step, so it is what a GPU step
would have to hide. Run it on a quiet machine only
(docs/simulator.md); the figures go in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.pyspy_top import Sampler, top_functions
from conveyor.bench.overlap_plot import plot_overlap
from conveyor.bench.steplog import read_step_log
from conveyor.launcher import LocalStack, StackSettings
from conveyor.logview import read_lines
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig
from services.worker.sim.overhead import GAP_EVENT
from shared.client import AsyncClient

PROMPT_TOKEN = 1000  # an ordinary token id: prompts are this id repeated


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="64,256,1024", help="running requests, comma-separated")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--gpu-step-ms", type=float, default=5.0, help="the GPU step to compare with")
    p.add_argument("--report-every", type=int, default=50, help="steps per worker log line")
    p.add_argument("--stream", action="store_true", help="stream tokens to the client")
    p.add_argument("--sim-model", default="llama-3-8b")
    p.add_argument("--sim-device", default="none", help="none (zero cost) or a profile: h200 ...")
    p.add_argument(
        "--sim-num-blocks",
        type=int,
        default=None,
        help="KV blocks the worker reports (default: what fits the device; long --output-len "
        "at 1,024 running needs more, else requests are preempted and the batch shrinks)",
    )
    p.add_argument("--async-scheduling", default="off,on", help="off | on | off,on (in order)")
    p.add_argument(
        "--steplog-png",
        type=Path,
        default=None,
        help="write a per-step timeline of the first N's runs (one panel per mode)",
    )
    p.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="profile scheduler, worker and tokenizer per function into this folder "
        "(bench/pyspy_top.py; needs py-spy in the venv)",
    )
    p.add_argument("--py-spy-window", default="3,8", help="seconds: delay,duration of sampling")
    p.add_argument("--out", type=Path, default=Path("results/sim_overhead.json"))
    return p.parse_args(argv)


async def _drive(address: str, n: int, args: argparse.Namespace) -> float:
    """Submit n requests at once and wait for all; returns the wall time."""
    prompt = [PROMPT_TOKEN] * args.prompt_len
    async with AsyncClient(address, timeout=600.0) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.generate(
                    prompt_token_ids=prompt,
                    max_tokens=args.output_len,
                    seed=i,
                    ignore_eos=True,
                    stream=args.stream,
                )
                for i in range(n)
            )
        )
        wall = time.perf_counter() - start
    short = [o for o in outs if len(o.token_ids) != args.output_len]
    if short:
        raise RuntimeError(f"{len(short)} requests ended early: {short[0].finish_reason}")
    return wall


def _gap_lines(log_dir: Path, n: int) -> list[dict[str, Any]]:
    """The worker's engine-gap summaries at batch n."""
    return [
        r for r in read_lines(log_dir) if r.get("event") == GAP_EVENT and r.get("num_seqs") == n
    ]


def _scheduler_gaps_us(log_dir: Path, n: int) -> list[float]:
    """The scheduler's own side of the gap, from its step log: a result frame's arrival to the
    next plan frame's send (decode, update, schedule, encode), for pure decode steps of n."""
    steps = read_step_log(log_dir / "scheduler.log")
    return [
        1e6 * s.gap_s for s in steps if s.num_seqs == n and s.is_decode_only and s.gap_s is not None
    ]


def _settings(n: int, args: argparse.Namespace, log_root: Path, overlap: bool) -> StackSettings:
    """A stack of the simulated worker for n running requests, overlap on or off."""
    return StackSettings(
        worker="sim",
        sim_config=SimConfig(
            device=args.sim_device,
            model=args.sim_model,
            report_every=args.report_every,
            num_blocks=args.sim_num_blocks or None,
        ),
        frontend_address=f"tcp://127.0.0.1:{_free_port()}",
        gateway=False,
        log_dir=log_root / f"running-{n}-async-{'on' if overlap else 'off'}",
        scheduler_config=SchedulerConfig(
            max_num_seqs=n,
            max_num_batched_tokens=max(n, 4096),
            max_waiting=max(n, 4096),
            async_scheduling=overlap,
        ),
    )


def measure(n: int, args: argparse.Namespace, log_root: Path, overlap: bool) -> dict[str, Any]:
    """One stack with n running requests; the summary of its engine gaps at batch n."""
    settings = _settings(n, args, log_root, overlap)
    sampler = None
    with LocalStack(settings) as stack:
        if args.py_spy is not None:
            delay, duration = (float(v) for v in args.py_spy_window.split(","))
            mode = f"running-{n}-async-{'on' if overlap else 'off'}"
            sampler = Sampler(stack.pids(), args.py_spy / mode, delay, duration)
            sampler.start()
        wall = asyncio.run(_drive(stack.frontend_address, n, args))
        if sampler is not None:
            sampler.join()
    lines = _gap_lines(Path(settings.log_dir), n)
    if not lines:
        raise RuntimeError(f"no {GAP_EVENT} lines at {n} running: raise --output-len")
    sched_gaps = sorted(_scheduler_gaps_us(Path(settings.log_dir), n))
    if not sched_gaps:
        raise RuntimeError(f"no scheduler step lines at {n} running")
    steps = sum(x["steps"] for x in lines)
    mean_us = sum(x["gap_mean_us"] * x["steps"] for x in lines) / steps
    every = read_step_log(Path(settings.log_dir) / "scheduler.log")
    device_s = sum(s.forward_s or 0.0 for s in every)  # the worker's own step times
    span_s = max(s.t_result for s in every) - min(s.t_plan for s in every)
    tokens = n * args.output_len
    if sampler is not None:
        _print_profiles(sampler, every, n, overlap)
    return {
        "running": n,
        "async_scheduling": overlap,
        "log_dir": str(settings.log_dir),
        "device_busy_s": round(device_s, 3),
        "engine_span_s": round(span_s, 3),
        "engine_tok_s": round(tokens / span_s, 1),
        # the pipeline's step time: the span per step of n tokens (one per running request)
        "period_us": round(1e6 * span_s * n / tokens, 1),
        "bound_tok_s": round(tokens / device_s, 1) if device_s > 0 else None,
        "of_bound": round(device_s / span_s, 4),
        "steps": steps,
        "gap_mean_us": round(mean_us, 1),
        "gap_p50_us": statistics.median(x["gap_p50_us"] for x in lines),
        "gap_p99_us": max(x["gap_p99_us"] for x in lines),
        "scheduler_gap_p50_us": round(statistics.median(sched_gaps), 1),
        "scheduler_gap_mean_us": round(statistics.mean(sched_gaps), 1),
        "worker_execute_mean_us": round(statistics.mean(x["execute_mean_us"] for x in lines), 1),
        "fraction_of_gpu_step": round(mean_us / (1000.0 * args.gpu_step_ms), 4),
        "wall_s": round(wall, 2),
        "output_tok_s": round(n * args.output_len / wall, 1),
    }


def _print_profiles(sampler: Sampler, steps: list[Any], n: int, overlap: bool) -> None:
    if sampler.window is None:
        print("py-spy: no window sampled (the run ended first: raise --output-len)")
        return
    begin, end = sampler.window
    num_steps = sum(1 for s in steps if begin <= s.t_result < end)
    print(f"py-spy at {n} running, async {'on' if overlap else 'off'}: {num_steps} steps "
          f"sampled; CPU us per step, self and total, by self")  # fmt: skip
    for name in sampler.pids:
        cpu = sampler.cpu_s.get(name, 0.0)
        print(f" {name}: CPU {1e6 * cpu / max(1, num_steps):.0f} us/step by /proc "
              f"({cpu / (end - begin):.0%} of a core)")  # fmt: skip
        for line in top_functions(sampler.out_dir / f"{name}.txt", num_steps, sampler.rate_hz):
            print(line)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sizes = [int(v) for v in args.running.split(",") if v.strip()]
    log_root = Path(tempfile.mkdtemp(prefix="sim-overhead-"))
    print(f"SIMULATED worker, device {args.sim_device}; logs under {log_root}")
    modes = [m.strip() == "on" for m in args.async_scheduling.split(",")]
    results = [measure(n, args, log_root, overlap) for n in sizes for overlap in modes]
    print(
        f"{'running':>8}{'async':>6}{'steps':>7}{'mean us':>10}{'p50 us':>9}{'p99 us':>9}"
        f"{f'of {args.gpu_step_ms:g} ms':>10}{'tok/s':>10}{'sched p50 us':>14}{'of bound':>10}"
        f"{'exec us':>9}{'period us':>11}"
    )
    for r in results:
        print(
            f"{r['running']:>8}{'on' if r['async_scheduling'] else 'off':>6}{r['steps']:>7}"
            f"{r['gap_mean_us']:>10.1f}{r['gap_p50_us']:>9.1f}"
            f"{r['gap_p99_us']:>9.1f}{r['fraction_of_gpu_step']:>10.1%}"
            f"{r['engine_tok_s']:>10.0f}{r['scheduler_gap_p50_us']:>14.1f}{r['of_bound']:>10.1%}"
            f"{r['worker_execute_mean_us']:>9.1f}{r['period_us']:>11.1f}"
        )
    if args.steplog_png is not None:
        first = [r for r in results if r["running"] == sizes[0]]
        plot_overlap([Path(r["log_dir"]) / "scheduler.log" for r in first],
                     [f"async {'on' if r['async_scheduling'] else 'off'}" for r in first],
                     args.steplog_png)  # fmt: skip
        print(f"wrote {args.steplog_png}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "sim_device": args.sim_device,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "stream": args.stream,
        "gpu_step_ms": args.gpu_step_ms,
    }
    args.out.write_text(json.dumps({"settings": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
