"""`python -m services.worker`: one worker rank (flags, else CONVEYOR_* variables).

Every WorkerConfig field is a flag (`--dtype float32`, `--kv-cache-memory 1GiB`, ...), and so is
every ParallelConfig field: one rank of a tensor-parallel group is
`--rank R --world-size N --dist-init tcp://HOST:PORT` (all ranks give the same address).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from services.worker.config import ParallelConfig, WorkerConfig
from services.worker.server import run_worker
from shared.addresses import DEFAULT_WORKER_ADDR
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import add_worker_key_flag, check_worker_keys
from shared.env import add_log_flags, env_path, env_str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__)
    p.add_argument(
        "--worker-addr",
        "--plan-addr",
        dest="worker_addr",
        default=env_str("WORKER_ADDR", DEFAULT_WORKER_ADDR),
        help="the scheduler's worker address to connect to (CONVEYOR_WORKER_ADDR)",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        default=env_path("READY_FILE"),
        help="created once ready, removed on exit (CONVEYOR_READY_FILE)",
    )
    # Internal frames only; not CONVEYOR_MAX_FRAME_BYTES, which limits clients' frames.
    p.add_argument("--max-frame-bytes", type=int, default=None,
                   help="larger plans get a WorkerFailure (default: no limit)")  # fmt: skip
    add_worker_key_flag(p)
    add_log_flags(p)
    add_config_flags(p, WorkerConfig)
    add_config_flags(p, ParallelConfig)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(parser, args, WorkerConfig)
    parallel = config_from_args(parser, args, ParallelConfig)
    try:
        check_worker_keys(args.curve_keys)
    except ValueError as exc:
        parser.error(str(exc))
    from shared.logging import configure_logging

    log = configure_logging(
        "worker", args.log_level, args.log_file, log_format=args.log_format
    ).bind(rank=parallel.rank)
    return run_worker(
        config,
        args.worker_addr,
        parallel,
        log,
        args.ready_file,
        args.max_frame_bytes,
        args.curve_keys,
    )


if __name__ == "__main__":
    sys.exit(main())
