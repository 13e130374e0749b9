"""`python -m services.scheduler`: the scheduler process (flags, else CONVEYOR_* variables).

Never imports torch: this process keeps to one thread so the worker has the cores (plus, with
--curve-keys, the ZAP authenticator's thread, idle but for worker and frontend handshakes).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Optional

import zmq

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.server import SchedulerServer, ServerConfig
from shared.addresses import DEFAULT_SCHEDULER_ADDR, DEFAULT_WORKER_ADDR
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import (
    AUTHORIZED_FRONTENDS_DIR,
    AUTHORIZED_WORKERS_DIR,
    FRONTENDS_DOMAIN,
    WORKERS_DOMAIN,
    check_server_keys,
    start_authenticator,
    stop_authenticator,
)
from shared.env import add_drain_flag, add_log_flags, env_float, env_int, env_path, env_str
from shared.logging import configure_logging
from shared.prefix_hash import cache_namespace
from shared.protocol.worker_channel import WorkerReady

# Which public keys each socket's ZAP domain admits (services/scheduler/*_link.py name them).
KEY_FOLDERS = {WORKERS_DOMAIN: AUTHORIZED_WORKERS_DIR, FRONTENDS_DOMAIN: AUTHORIZED_FRONTENDS_DIR}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    p.add_argument(
        "--scheduler-addr",
        default=env_str("SCHEDULER_ADDR", DEFAULT_SCHEDULER_ADDR),
        help="bind address for frontends (CONVEYOR_SCHEDULER_ADDR)",
    )
    p.add_argument(
        "--worker-addr",
        default=env_str("WORKER_ADDR", DEFAULT_WORKER_ADDR),
        help="bind address for the worker rank(s) (CONVEYOR_WORKER_ADDR)",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=env_int("NUM_WORKERS", 1),
        help="worker ranks to wait for (CONVEYOR_NUM_WORKERS)",
    )
    # Internal frames only; not CONVEYOR_MAX_FRAME_BYTES, which limits clients' frames.
    p.add_argument("--max-frame-bytes", type=int, default=16 << 20,
                   help="larger frames from a frontend are dropped (default 16 MiB)")  # fmt: skip
    p.add_argument(
        "--frontend-timeout",
        type=float,
        default=env_float("FRONTEND_TIMEOUT", 10.0),
        help="seconds of frontend silence before its requests are aborted",
    )
    add_drain_flag(p)
    p.add_argument(
        "--summary-interval",
        type=float,
        default=env_float("SUMMARY_INTERVAL", 5.0),
        help="seconds between engine_summary log lines while busy; 0 turns them off",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=env_int("MAX_RETRIES", 3),
        help="restarts by recompute a request gets when the worker is lost, then worker_failed "
        "(CONVEYOR_MAX_RETRIES)",
    )
    p.add_argument(
        "--requeue-timeout",
        type=float,
        default=env_float("REQUEUE_TIMEOUT", 30.0),
        help="seconds requeued requests wait for a worker before worker_failed",
    )
    p.add_argument(
        "--curve-keys",
        type=Path,
        default=env_path("CURVE_KEYS"),
        help="CURVE on both sockets: the folder of `conveyor keys generate`; only "
        "authorized_workers/ may connect as workers, authorized_frontends/ as frontends "
        "(CONVEYOR_CURVE_KEYS)",
    )
    add_log_flags(p)
    add_config_flags(p, SchedulerConfig)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sched_config = config_from_args(parser, args, SchedulerConfig)
    try:
        server_config = ServerConfig(
            frontend_address=args.scheduler_addr,
            worker_address=args.worker_addr,
            num_workers=args.num_workers,
            max_frame_bytes=args.max_frame_bytes,
            frontend_timeout_s=args.frontend_timeout,
            drain_timeout_s=args.drain_timeout,
            summary_interval_s=args.summary_interval,
            max_retries=args.max_retries,
            requeue_timeout_s=args.requeue_timeout,
            curve_keys=args.curve_keys,
        )
        if args.curve_keys is not None:
            for folder in KEY_FOLDERS.values():
                check_server_keys(args.curve_keys, folder)
    except ValueError as exc:
        parser.error(str(exc))
    log = configure_logging("scheduler", args.log_level, args.log_file, log_format=args.log_format)
    log.info("scheduler_config", **{k: v for k, v in vars(args).items() if k != "log_file"})

    def make_scheduler(ready: WorkerReady) -> Scheduler:
        return Scheduler(
            sched_config,
            ready.num_blocks,
            ready.block_size,
            ready.max_model_len,
            list(ready.eos_token_ids),
            clock=time.time,
            cache_namespace=cache_namespace(ready.model_name, ready.dtype),
        )

    # The ZAP handler (none without --curve-keys) admitting authorized_workers/ on the worker
    # socket and authorized_frontends/ on the frontend socket, in the context the server's
    # sockets use, running before they bind.
    auth = start_authenticator(zmq.Context.instance(), args.curve_keys, log, domains=KEY_FOLDERS)
    try:
        server = SchedulerServer(server_config, make_scheduler, log, zmq.Context.instance())
    except BaseException:
        stop_authenticator(auth)
        raise

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        log.info("signal", signum=signum)
        server.request_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return server.run()
    finally:
        stop_authenticator(auth)


if __name__ == "__main__":
    sys.exit(main())
