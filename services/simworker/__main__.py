"""`python -m services.simworker --sim-device h200 --sim-model llama-3-8b --plan-addr ADDR`.

A SIMULATED worker process: the same handshake, plans and results as the real worker, with no
model behind them (docs/simulator.md). Never the launcher's default.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from services.simworker.config import WEIGHT_DTYPE_BYTES, SimConfig
from services.simworker.profiles import DEVICES, MODELS
from services.simworker.runner import SimRunner
from shared.env import env_str
from shared.logging import configure_logging
from shared.worker_server import serve_worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.simworker",
        description="SIMULATED worker: answers step plans after a modelled step time.",
    )
    p.add_argument("--sim-device", default="h200", choices=sorted(DEVICES))
    p.add_argument("--sim-model", default="llama-3-8b", choices=sorted(MODELS))
    p.add_argument(
        "--sim-profile",
        type=Path,
        default=None,
        help="device profile JSON (from `conveyor sim calibrate`); overrides --sim-device",
    )
    p.add_argument("--sim-weight-dtype", default="bfloat16", choices=sorted(WEIGHT_DTYPE_BYTES))
    p.add_argument("--sim-block-size", type=int, default=16)
    p.add_argument(
        "--sim-num-blocks",
        type=int,
        default=None,
        help="KV blocks to report (default: what fits in the device's memory)",
    )
    p.add_argument("--sim-max-model-len", type=int, default=None)
    p.add_argument(
        "--sim-eos-probability",
        type=float,
        default=0.0,
        help="chance each output token is end-of-sequence (default 0: never)",
    )
    p.add_argument(
        "--sim-report-every",
        type=int,
        default=200,
        help="decode steps per batch size between engine-gap log lines",
    )
    p.add_argument(
        "--plan-addr",
        default=env_str("WORKER_ADDR"),
        help="the scheduler's worker address (default $CONVEYOR_WORKER_ADDR)",
    )
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--log-level", default=env_str("LOG_LEVEL", "info"))
    p.add_argument("--log-file", type=Path, default=None)
    p.add_argument("--ready-file", type=Path, default=None)
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        device=args.sim_device,
        model=args.sim_model,
        profile_path=args.sim_profile,
        weight_dtype=args.sim_weight_dtype,
        block_size=args.sim_block_size,
        num_blocks=args.sim_num_blocks,
        max_model_len=args.sim_max_model_len,
        eos_probability=args.sim_eos_probability,
        report_every=args.sim_report_every,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.plan_addr:
        parser.error("--plan-addr is required (or set CONVEYOR_WORKER_ADDR)")
    log_file = args.log_file
    if log_file is None and env_str("LOG_DIR"):
        log_file = Path(env_str("LOG_DIR") or ".") / "worker.log"
    log = configure_logging("simworker", args.log_level, log_file).bind(simulated=True)
    try:
        runner = SimRunner(config_from_args(args), log)
    except ValueError as exc:
        log.error("sim_worker_config", message=str(exc))
        print(f"SIMULATED worker: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return serve_worker(
        runner, args.plan_addr, args.rank, log, stop=stop, ready_file=args.ready_file
    )


if __name__ == "__main__":
    sys.exit(main())
