"""`python -m services.worker.sim --sim-device h200 --sim-model llama-3-8b --plan-addr ADDR`.

A SIMULATED worker process: the same handshake, plans and results as the real worker, with no
model behind them (docs/simulator.md). Never the launcher's default. The process flags
(`--plan-addr`/`--worker-addr`, `--rank`, `--ready-file`, `--log-file`, ...) are the real
worker's; the `--sim-*` flags choose what is simulated.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

from services.worker.loop import StepRunner, serve_worker
from services.worker.sim.config import WEIGHT_DTYPE_BYTES, SimConfig
from services.worker.sim.faults import FaultInjectingRunner
from services.worker.sim.profiles import DEVICES, MODELS
from services.worker.sim.runner import SimRunner
from shared.addresses import DEFAULT_WORKER_ADDR
from shared.curve import add_worker_key_flag, check_worker_keys
from shared.env import add_log_flags, env_int, env_path, env_str
from shared.logging import configure_logging

EXIT_BAD_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.worker.sim",
        description="SIMULATED worker: answers step plans after a modelled step time.",
    )
    sim = p.add_argument_group("simulation")
    sim.add_argument("--sim-device", default="h200", choices=sorted(DEVICES))
    sim.add_argument("--sim-model", default="llama-3-8b", choices=sorted(MODELS))
    sim.add_argument(
        "--sim-profile",
        type=Path,
        default=None,
        help="device profile JSON (`conveyor sim calibrate`); overrides --sim-device",
    )
    sim.add_argument("--sim-weight-dtype", default="bfloat16", choices=sorted(WEIGHT_DTYPE_BYTES))
    sim.add_argument("--sim-block-size", type=int, default=16)
    sim.add_argument(
        "--sim-num-blocks",
        type=int,
        default=None,
        help="KV blocks to report (default: what fits in the device's memory)",
    )
    sim.add_argument("--sim-max-model-len", type=int, default=None)
    sim.add_argument(
        "--sim-eos-probability",
        type=float,
        default=0.0,
        help="chance each output token is end-of-sequence (default 0: never)",
    )
    sim.add_argument(
        "--sim-report-every",
        type=int,
        default=200,
        help="decode steps per batch size between engine-gap log lines",
    )
    sim.add_argument(
        "--sim-fail-token",
        type=int,
        default=None,
        help="fault injection: steps holding a request whose prompt contains this token id "
        "fail (services/worker/sim/faults.py)",
    )
    sim.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=env_int("TENSOR_PARALLEL_SIZE", 1),
        help="model N devices of one tensor-parallel group in this one process (their "
        "all-reduces over the device's interconnect; CONVEYOR_TENSOR_PARALLEL_SIZE)",
    )
    proc = p.add_argument_group("process (as the real worker's)")
    proc.add_argument(
        "--plan-addr",
        "--worker-addr",
        dest="plan_addr",
        default=env_str("WORKER_ADDR", DEFAULT_WORKER_ADDR),
        help="the scheduler's worker address (CONVEYOR_WORKER_ADDR)",
    )
    proc.add_argument("--rank", type=int, default=env_int("RANK", 0))
    proc.add_argument(
        "--world-size",
        type=int,
        default=env_int("WORLD_SIZE", 1),
        help="processes standing in for the ranks of one group, each modelling the whole step "
        "(the scheduler's multi-rank tests); --tensor-parallel-size models N ranks in one",
    )
    proc.add_argument("--ready-file", type=Path, default=env_path("READY_FILE"))
    proc.add_argument("--max-frame-bytes", type=int, default=env_int("MAX_FRAME_BYTES", None))
    add_worker_key_flag(proc)
    add_log_flags(proc)
    return p  # fmt: skip


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
        tensor_parallel_size=args.tensor_parallel_size,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.rank < args.world_size:
        parser.error("--rank must be in 0 .. --world-size - 1")
    try:
        check_worker_keys(args.curve_keys)
    except ValueError as exc:
        parser.error(str(exc))
    log = configure_logging("simworker", args.log_level, args.log_file, log_format=args.log_format)
    log = log.bind(rank=args.rank, simulated=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        runner: StepRunner = SimRunner(config_from_args(args), log, world_size=args.world_size)
    except ValueError as exc:  # a bad flag value or a model that does not fit the device
        log.error("bad_worker_config", message=f"SIMULATED worker: {exc}")
        return EXIT_BAD_CONFIG
    if args.sim_fail_token is not None:
        runner = FaultInjectingRunner(runner, args.sim_fail_token, log)
    return serve_worker(
        runner,
        args.plan_addr,
        args.rank,
        log,
        stop=stop,
        ready_file=args.ready_file,
        max_frame_bytes=args.max_frame_bytes,
        curve_keys=args.curve_keys,
    )


if __name__ == "__main__":
    sys.exit(main())
