"""`python -m services.worker`: one worker rank (flags, else CONVEYOR_* variables).

Every WorkerConfig field is a flag (`--dtype float32`, `--kv-cache-memory 1GiB`, ...), and so is
every ParallelConfig field: one rank of a tensor-parallel group is
`--rank R --world-size N --dist-init tcp://HOST:PORT` (all ranks give the same address).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from services.worker.config import ParallelConfig, WorkerConfig
from services.worker.process_config import WorkerProcessConfig
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import check_worker_keys
from shared.env import LogConfig

CONFIGS = (WorkerConfig, ParallelConfig, WorkerProcessConfig, LogConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    for cls in CONFIGS:
        add_config_flags(p, cls)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config, parallel, link, logs = (config_from_args(parser, args, c) for c in CONFIGS)
    try:
        check_worker_keys(link.curve_keys)
    except ValueError as exc:
        parser.error(str(exc))
    # Imported here: the parser (--help, docs/cli.md) needs none of the serving code.
    from services.worker.server import run_worker
    from shared.logging import configure_logging
    from shared.tracing import start_tracing

    log = configure_logging(
        "worker", logs.log_level, logs.log_file, log_format=logs.log_format
    ).bind(rank=parallel.rank)
    tracing = start_tracing("worker", logs.otlp_endpoint, log)
    try:
        return run_worker(
            config,
            link.worker_addr,
            parallel,
            log,
            link.ready_file,
            link.max_frame_bytes,
            link.curve_keys,
            tracing,
            link.kv_addr,
            link.kv_pull_timeout_s,
        )
    finally:
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
