"""`python -m services.scheduler`: the scheduler process (flags, else CONVEYOR_* variables).

Never imports torch: this process keeps to one thread so the worker has the cores (plus, with
--curve-keys, the ZAP authenticator's thread, idle but for worker and frontend handshakes).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from types import FrameType
from typing import Optional

import zmq

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.server import SchedulerServer
from services.scheduler.server_config import ServerConfig
from services.scheduler.tracing import SchedulerTrace
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
from shared.env import LogConfig
from shared.logging import configure_logging
from shared.prefix_hash import cache_namespace
from shared.protocol.worker_channel import WorkerReady
from shared.tracing import start_tracing

# Which public keys each socket's ZAP domain admits (services/scheduler/*_link.py name them).
KEY_FOLDERS = {WORKERS_DOMAIN: AUTHORIZED_WORKERS_DIR, FRONTENDS_DOMAIN: AUTHORIZED_FRONTENDS_DIR}


CONFIGS = (SchedulerConfig, ServerConfig, LogConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.scheduler", description=__doc__)
    for cls in CONFIGS:
        add_config_flags(p, cls)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sched_config, server_config, logs = (config_from_args(parser, args, c) for c in CONFIGS)
    if server_config.curve_keys is not None:
        try:
            for folder in KEY_FOLDERS.values():
                check_server_keys(server_config.curve_keys, folder)
        except ValueError as exc:
            parser.error(str(exc))
    log = configure_logging("scheduler", logs.log_level, logs.log_file, log_format=logs.log_format)
    log.info("scheduler_config", **dataclasses.asdict(sched_config),
             **dataclasses.asdict(server_config))  # fmt: skip
    tracing = start_tracing("scheduler", logs.otlp_endpoint, log)
    trace = SchedulerTrace(tracing) if tracing is not None else None

    def make_scheduler(ready: WorkerReady) -> Scheduler:
        return Scheduler(
            sched_config,
            ready.num_blocks,
            ready.block_size,
            ready.max_model_len,
            list(ready.eos_token_ids),
            clock=time.time,
            cache_namespace=cache_namespace(
                ready.model_name,
                ready.dtype,
                extra=f"quantization={ready.quantization};kv={ready.kv_cache_dtype}",
            ),
            speculative=ready.proposer is not None,
            trace=trace,
        )

    # The ZAP handler (none without --curve-keys) admitting authorized_workers/ on the worker
    # socket and authorized_frontends/ on the frontend socket, in the context the server's
    # sockets use, running before they bind.
    auth = start_authenticator(
        zmq.Context.instance(), server_config.curve_keys, log, domains=KEY_FOLDERS
    )
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
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
