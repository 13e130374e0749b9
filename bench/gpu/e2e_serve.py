"""One model served by `conveyor up`, measured with `conveyor bench` bursts.

Starts `python -m conveyor up --model DIR --device D ...` (every service a real process, on free
loopback ports, logs to `--log-dir`), waits for its "serving on" line, sends one small unrecorded
warm-up burst (Triton compiles its kernels on first use; it samples at temperature 1, so the
random sampling path runs too), then for each burst size N runs
`conveyor bench --num-prompts N --max-concurrency N` (all N sent at once, EOS ignored)
and reads the scheduler's step log for the steps inside that burst's window. Stops the stack
with SIGINT (the same as Ctrl-C) and waits for it to exit.

Per burst it records the bench figures (output tok/s, TTFT/TPOT/ITL percentiles) and, from the
step log: the step time (plan sent -> result back), the step period (one plan to the next), the
worker's `forward_s` (its `execute`: inputs, forward and sampling, device synchronized by the
sampled tokens) and the share of the period spent outside it (the scheduler, both transports,
the frontend), over all steps and over the steps with the whole burst running. On CUDA also
the device's idle time between forward passes over the burst, from the worker's `device_time`
log lines (services/worker/pipeline.py DeviceClock): what step pipelining (`--pipeline-steps`,
on by default on CUDA; `off` for the comparison stage) is meant to shrink.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.steplog import StepEntry, read_step_log

ROOT = Path(__file__).resolve().parents[2]
FULL_SHARE = 0.9  # "whole burst running": at least this share of the burst in the step
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_flags(values: dict[str, Any]) -> list[str]:
    """{"max_num_seqs": 8} -> ["--max-num-seqs", "8"]."""
    return [item for k, v in values.items() for item in ("--" + k.replace("_", "-"), str(v))]


def up_command(args: argparse.Namespace, frontend: str, http_port: int) -> list[str]:
    biggest = max(args.bursts)
    flags = {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "max_num_seqs": biggest,
        "max_num_batched_tokens": max(args.max_num_batched_tokens, biggest),
        "chunk_size": args.chunk_size, "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory, "frontend_addr": frontend,
        "http_port": http_port, "log_dir": args.log_dir, "ready_timeout": args.ready_timeout,
        "pipeline_steps": args.pipeline_steps,
    }  # fmt: skip
    cmd = [sys.executable, "-m", "conveyor", "up", *as_flags(flags), "--quiet"]
    return cmd + ([] if args.gateway else ["--no-gateway"])


def wait_serving(proc: subprocess.Popen, out_path: Path, timeout_s: float) -> Optional[str]:
    """None once `conveyor up` printed its "serving on" line; else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "serving on" in out_path.read_text(errors="replace"):
            return None
        if proc.poll() is not None:
            return f"conveyor up exited with code {proc.returncode} before serving"
        time.sleep(0.2)
    return f"conveyor up not serving after {timeout_s:.0f} s"


def bench(
    args: argparse.Namespace,
    frontend: str,
    size: int,
    scale: float,
    out: Path,
    seed: int,
    temperature: float = 0.0,
) -> tuple[Optional[dict[str, Any]], float, float]:
    """One burst through `conveyor bench` (its `main`, in this process: the same code as the
    command, without a second interpreter start); (result.json or None, wall start, wall end)."""
    from conveyor.bench.cli import main as bench_main

    flags = {
        "address": frontend, "workload": args.workload, "num_prompts": size,
        "max_concurrency": size, "scale": scale, "seed": seed, "temperature": temperature,
        "percentiles": "50,90,99",
        "out": out, "log_dir": args.log_dir,
    }  # fmt: skip
    argv = [*as_flags(flags), "--ignore-eos", "--no-plots", "--no-progress"]
    print(f"gpu_e2e_serve: conveyor bench {' '.join(argv)}", flush=True)
    start = time.time()
    try:
        bench_main(argv)  # prints its result table; exit status 1 when a request failed
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - recorded as this burst's failure
        print(f"gpu_e2e_serve: conveyor bench failed: {type(exc).__name__}: {exc}", flush=True)
    end = time.time()
    result_path = out / "result.json"
    if not result_path.exists():
        return None, start, end
    return json.loads(result_path.read_text()), start, end


def step_stats(steps: list[StepEntry], size: int) -> dict[str, Any]:
    """Step time, period and the share outside the worker's execute (see the module doc)."""
    if len(steps) < 2:
        return {"num_steps": len(steps)}
    pairs = list(zip(steps, steps[1:], strict=False))

    def summary(chosen: list[tuple[StepEntry, StepEntry]]) -> dict[str, Any]:
        periods = [b.t_plan - a.t_plan for a, b in chosen]
        forward = [a.forward_s or 0.0 for a, _ in chosen]
        step_ms = sorted(1000.0 * a.step_s for a, _ in chosen)
        return {
            "num_steps": len(chosen),
            "mean_step_ms": sum(step_ms) / len(step_ms),
            "median_step_ms": step_ms[len(step_ms) // 2],
            "mean_period_ms": 1000.0 * sum(periods) / len(periods),
            "mean_forward_ms": 1000.0 * sum(forward) / len(forward),
            "outside_forward_share": 1.0 - sum(forward) / sum(periods),
            "mean_num_seqs": sum(a.num_seqs for a, _ in chosen) / len(chosen),
        }

    full = [(a, b) for a, b in pairs if a.num_seqs >= FULL_SHARE * size]
    decode = [(a, b) for a, b in pairs if a.is_decode_only]
    return {
        "all": summary(pairs),
        "full_batch": summary(full) if full else None,
        "decode_only": summary(decode) if decode else None,
    }


def device_time(log_dir: Path, start: float, end: float) -> Optional[dict[str, Any]]:
    """The device's busy and idle time between forward passes over [start, end] (wall clock),
    from the difference of the first and last cumulative `device_time` lines the worker logged
    in that window (every 32 steps); None when fewer than two (the CPU logs none)."""
    marks = []
    for path in sorted(log_dir.glob("worker*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if '"device_time"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "device_time" and start <= rec.get("t", -1.0) <= end:
                marks.append(rec)
    if len(marks) < 2:
        return None
    first, last = min(marks, key=lambda r: r["t"]), max(marks, key=lambda r: r["t"])
    steps = last["num_steps"] - first["num_steps"]
    idle, busy = last["idle_s"] - first["idle_s"], last["busy_s"] - first["busy_s"]
    return {
        "num_steps": steps,
        "idle_share": idle / (idle + busy) if idle + busy > 0 else None,
        "mean_idle_us": 1e6 * idle / steps if steps else None,
        "mean_busy_us": 1e6 * busy / steps if steps else None,
        "last_idle_p50_us": last.get("idle_p50_us"),
    }


BENCH_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "total_token_throughput",
    "request_throughput",
)
LATENCY_KEYS = tuple(
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")
)


def run_bursts(args: argparse.Namespace, frontend: str, report: dict[str, Any]) -> None:
    # the warm-up samples at temperature 1 (the measured bursts are greedy), so the random
    # sampling path runs on the device too
    warm, start, end = bench(
        args, frontend, args.warmup_prompts, args.warmup_scale, args.log_dir / "warmup", seed=1,
        temperature=1.0,
    )  # fmt: skip
    report["warmup"] = {"ok": bool(warm and warm["failed"] == 0), "seconds": end - start}
    for size in args.bursts:
        result, start, end = bench(
            args, frontend, size, args.scale, args.log_dir / f"burst-{size}", seed=0
        )
        row: dict[str, Any] = {"burst": size, "ok": bool(result and result["failed"] == 0)}
        if result is not None:
            row.update({k: result.get(k) for k in BENCH_KEYS + LATENCY_KEYS})
        steps = read_step_log(args.log_dir / "scheduler.log", start, end)
        row["steps"] = step_stats(steps, size)
        row["device_time"] = device_time(args.log_dir, start, end)
        report["bursts"].append(row)
        print(
            f"gpu_e2e_serve: burst {size}: ok={row['ok']} "
            f"out tok/s={row.get('output_throughput')} steps={row['steps'].get('all')}",
            flush=True,
        )


def print_tails(log_dir: Path, num_lines: int = 15) -> None:
    """The end of `conveyor up`'s output and of each service's log, for a failed run."""
    for path in [log_dir / "up.out", *sorted(log_dir.glob("*.log"))]:
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            keep = [line for line in lines if '"event":"step"' not in line][-num_lines:]
            print(f"--- {path.name}\n" + "\n".join(keep), flush=True)


def stop(proc: subprocess.Popen) -> Optional[int]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: drain, stop every service
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bursts", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256])
    p.add_argument("--workload", default="mixed")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--warmup-scale", type=float, default=0.1)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="16GiB")
    p.add_argument("--no-gateway", dest="gateway", action="store_false")
    p.add_argument("--pipeline-steps", choices=("auto", "on", "off"), default="auto",
                   help="the worker's step pipelining (auto: on on CUDA)")  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    frontend = f"tcp://127.0.0.1:{free_port()}"
    cmd = up_command(args, frontend, free_port())
    report: dict[str, Any] = {
        "ok": False,
        "model": str(args.model),
        "device": args.device,
        "dtype": args.dtype,
        "gateway": args.gateway,
        "pipeline_steps": args.pipeline_steps,
        "command": " ".join(cmd[1:]),
        "error": None,
        "bursts": [],
    }
    up_out = args.log_dir / "up.out"
    start = time.monotonic()
    with open(up_out, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        report["error"] = wait_serving(proc, up_out, args.ready_timeout)
        report["ready_s"] = round(time.monotonic() - start, 2)
        print(
            f"gpu_e2e_serve: {args.model.name}: ready in {report['ready_s']} s "
            f"({report['error'] or 'serving'})",
            flush=True,
        )
        if report["error"] is None:
            run_bursts(args, frontend, report)
    finally:
        report["up_exit_code"] = stop(proc)
        if report["error"] is not None or not all(b["ok"] for b in report["bursts"]):
            print_tails(args.log_dir)
    report["ok"] = (
        report["error"] is None
        and report.get("warmup", {}).get("ok", False)
        and all(b["ok"] for b in report["bursts"])
        and report["up_exit_code"] == 0
    )
    args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
