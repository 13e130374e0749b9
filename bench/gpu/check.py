"""GPU check: every Triton kernel against its reference on the device, then timings.

Run on a CUDA machine with torch and triton installed (nothing else: it imports only torch,
triton, numpy, the standard library and this repository's kernels/ and bench/gpu_*.py):

    bench/gpu/check.sh [--out results/gpu_check.json] [--time-limit 390]

Sections: kernel checks; device-to-device copy bandwidth; decode attention at batch 1-256 x
context 1k-8k (GB/s of K/V read, and its share of the copy bandwidth); prefill attention
(TFLOP/s); one engine step of a 1B-class Llama with random weights at batch 1-256. It stops
itself before 7 minutes (a soft limit between cases, a hard alarm after it), writes JSON and
prints a table last. `--dry-run` runs tiny sizes on CPU under TRITON_INTERPRET=1 to prove the
script works; its timings mean nothing. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
HARD_STOP_MARGIN_S = 20  # the alarm fires this long after the soft limit; both under 7 min


class TimeUp(Exception):
    """Raised by the alarm when a case overruns the hard limit."""


class Deadline:
    """The soft time limit: no new case starts after it."""

    def __init__(self, limit_s: float) -> None:
        self.start, self.limit_s = time.monotonic(), limit_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return self.elapsed() > self.limit_s


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "results" / "gpu_check.json"))
    p.add_argument("--time-limit", type=float, default=390.0, help="soft limit, seconds")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (interpreter)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to exercise the script on CPU)")
        return 2
    report = _new_report(torch, args)  # imports triton: seconds on a busy machine
    deadline = Deadline(args.time_limit)  # counts from here, so a short limit still runs a case
    previous = signal.signal(signal.SIGALRM, _raise_time_up)
    signal.alarm(int(args.time_limit + HARD_STOP_MARGIN_S))
    try:
        _run_sections(report, deadline, args.dry_run)
    except TimeUp:
        report["stopped_early"] = "hard time limit"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    report["elapsed_s"] = round(deadline.elapsed(), 1)
    report["all_checks_passed"] = bool(report["checks"]) and all(
        c.get("ok") for c in report["checks"]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"gpu_check: wrote {out}")
    print_table(report)
    return 0 if report["all_checks_passed"] else 1


def _raise_time_up(signum: int, frame: Any) -> None:
    raise TimeUp()


def _new_report(torch: Any, args: argparse.Namespace) -> dict[str, Any]:
    import triton

    device = "cpu (interpreter, dry run)" if args.dry_run else torch.cuda.get_device_name()
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "time_limit_s": args.time_limit,
        "stopped_early": None,
        "checks": [],
        "copy": {},
        "decode_attention": [],
        "prefill_attention": [],
        "engine_step": [],
    }


def _run_sections(report: dict[str, Any], deadline: Deadline, dry: bool) -> None:
    from bench.gpu import timing as gpu_timing
    from bench.gpu.kernel_checks import attention_cases, small_kernel_cases

    device = "cpu" if dry else "cuda"
    for cases in (small_kernel_cases(device, dry), attention_cases(device, dry)):
        for name, check in cases:
            if deadline.expired():
                report["stopped_early"] = "soft time limit (checks)"
                return
            started = time.monotonic()
            result = _guarded(check)
            report["checks"].append({"name": name, **result,
                                     "seconds": round(time.monotonic() - started, 3)})  # fmt: skip
            print(f"check {name}: {report['checks'][-1]}", flush=True)
    report["copy"] = gpu_timing.copy_bandwidth(device, dry)
    sections: list[tuple[str, Callable[..., list[dict[str, Any]]]]] = [
        ("decode_attention", gpu_timing.decode_attention),
        ("prefill_attention", gpu_timing.prefill_attention),
        ("engine_step", gpu_timing.engine_step),
    ]
    for key, run in sections:
        report[key] = run(device, dry, deadline.expired, report["copy"])
        if deadline.expired():
            report["stopped_early"] = f"soft time limit ({key})"
            return


def _guarded(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    # A kernel that fails to compile or raises is a failed check, not the end of the run.
    try:
        return check()
    except TimeUp:
        raise
    except Exception as e:  # noqa: BLE001 - recorded in the report as the check's failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}


def print_table(report: dict[str, Any]) -> None:
    """The human summary, printed last."""
    lines = [f"== GPU check on {report['device']} (torch {report['torch']}, "
             f"triton {report['triton']}), {report['elapsed_s']} s =="]  # fmt: skip
    checks = report["checks"]
    failed = [c for c in checks if not c.get("ok")]
    lines.append(f"kernel checks: {len(checks) - len(failed)}/{len(checks)} passed")
    for c in failed:
        lines.append(f"  FAILED {c['name']}: {c.get('error') or c.get('max_abs_diff')}")
    copy = report["copy"]
    if copy:
        lines.append(f"device copy: {copy['gb_s']:.0f} GB/s (read + write, {copy['mib']} MiB)")
    lines.append("decode attention    batch  context  head_dim   us/call  GB/s   % of copy")
    for r in report["decode_attention"]:
        lines.append(
            f"                    {r['batch']:5d}  {r['context']:7d}  {r['head_dim']:8d}  "
            f"{r['us']:8.1f}  {r['gb_s']:6.0f}  {r['pct_copy']:6.1f}   ({r['timing']})"
        )
    lines.append("prefill attention   seqs x len  head_dim        ms  TFLOP/s")
    for r in report["prefill_attention"]:
        shape = f"{r['seqs']} x {r['seq_len']}"
        lines.append(
            f"                    {shape:>10}  {r['head_dim']:8d}  {r['ms']:8.2f}  "
            f"{r['tflop_s']:7.1f}"
        )
    lines.append("engine step         kind    batch  new tokens  context   ms/step  tokens/s")
    for r in report["engine_step"]:
        lines.append(
            f"  {r['model']:>16}  {r['kind']:6}  {r['batch']:5d}  {r['new_tokens']:10d}  "
            f"{r['context']:7d}  {r['ms']:8.2f}  {r['tokens_s']:8.0f}"
        )
    if report["stopped_early"]:
        lines.append(f"stopped early: {report['stopped_early']}")
    lines.append("ALL CHECKS PASSED" if report["all_checks_passed"] else "SOME CHECKS FAILED")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
