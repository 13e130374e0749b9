"""`python -m services.worker.sim --sim-device h200 --sim-model llama-3-8b --worker-addr ADDR`.

A SIMULATED worker process: the same handshake, plans and results as the real worker, with no
model behind them (docs/simulator.md). Never the launcher's default. The process flags
(`--worker-addr`/`--plan-addr`, `--rank`, `--ready-file`, `--log-file`, ...) are the real
worker's; the `--sim-*` flags (SimConfig) choose what is simulated.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Optional

from services.worker.config import ParallelConfig
from services.worker.loop import StepRunner, serve_worker
from services.worker.process_config import WorkerProcessConfig
from services.worker.sim.config import SimConfig
from services.worker.sim.faults import FaultInjectingRunner
from services.worker.sim.kv_link import (
    KV_LINKS,
    SimKvPool,
    kv_during_steps,
    sim_kv_transfer,
)
from services.worker.sim.runner import SimRunner
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import check_worker_keys
from shared.env import LogConfig
from shared.logging import configure_logging

EXIT_BAD_CONFIG = 2
# (config, its fields that are flags here; None: all). `world_size` here: processes standing in
# for the ranks of one group, each modelling the whole step (the scheduler's multi-rank tests);
# --tensor-parallel-size models N ranks in one.
CONFIGS: tuple[tuple[type, Optional[tuple[str, ...]]], ...] = (
    (SimConfig, None),
    (ParallelConfig, ("rank", "world_size")),
    (WorkerProcessConfig, None),
    (LogConfig, None),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.worker.sim",
        description="SIMULATED worker: answers step plans after a modelled step time.",
    )
    for cls, only in CONFIGS:
        add_config_flags(p, cls, only=only)
    return p


def parse_args(argv: Optional[list[str]] = None) -> tuple[Any, ...]:
    """(SimConfig, ParallelConfig, WorkerProcessConfig, LogConfig); bad values exit."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = tuple(config_from_args(parser, args, cls, only=only) for cls, only in CONFIGS)
    try:
        check_worker_keys(configs[2].curve_keys)
    except ValueError as exc:
        parser.error(str(exc))
    return configs


def main(argv: Optional[list[str]] = None) -> int:
    sim, parallel, link, logs = parse_args(argv)
    log = configure_logging("simworker", logs.log_level, logs.log_file, log_format=logs.log_format)
    log = log.bind(rank=parallel.rank, simulated=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        # the KV hand-over (disaggregation), as the real worker: one rank only
        one_sided = sim.one_sided_reads()
        pool = SimKvPool(sim.device_profile(), sim.model_shape(), sim.block_size,
                         KV_LINKS[sim.kv_link], one_sided)  # fmt: skip
        kv = sim_kv_transfer(pool, link, log) if parallel.world_size == 1 else None
        wait = kv_during_steps(kv, one_sided) if kv is not None else None
        runner: StepRunner = SimRunner(sim, log, world_size=parallel.world_size, wait=wait)
    except ValueError as exc:  # a bad flag value or a model that does not fit the device
        log.error("bad_worker_config", message=f"SIMULATED worker: {exc}")
        return EXIT_BAD_CONFIG
    if sim.fail_token is not None:
        runner = FaultInjectingRunner(runner, sim.fail_token, log)
    try:
        return serve_worker(
            runner,
            link.worker_addr,
            parallel.rank,
            log,
            stop=stop,
            ready_file=link.ready_file,
            max_frame_bytes=link.max_frame_bytes,
            curve_keys=link.curve_keys,
            kv=kv,
        )
    finally:
        if kv is not None:
            kv.close()


if __name__ == "__main__":
    sys.exit(main())
