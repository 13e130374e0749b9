"""The worker process: WorkerConfig -> ModelRunner -> services.worker.loop.serve_worker.

The loop itself lives in services/worker/loop.py so simulated workers run the very same one.
SIGTERM/SIGINT set a stop event: the loop finishes the step it is in, then exits with 0.
A tensor-parallel rank that cannot join its group (a peer missing past the time-out) exits with
EXIT_GROUP_LOST, like one whose group broke while serving.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from services.worker.config import ParallelConfig, WorkerConfig, check_model_divides
from services.worker.loop import EXIT_GROUP_LOST, serve_worker
from services.worker.steps import FatalWorkerError
from services.worker.tracing import StepTrace
from shared.tracing import Tracing

EXIT_BAD_CONFIG = 2


def run_worker(
    config: WorkerConfig,
    plan_address: str,
    parallel: ParallelConfig,
    log: Any,
    ready_file: Optional[Path] = None,
    max_frame_bytes: Optional[int] = None,
    curve_keys: Optional[Path] = None,
    tracing: Optional[Tracing] = None,
    kv_addr: Optional[str] = None,
    kv_pull_timeout_s: float = 1.0,
) -> int:
    """Load the model, then serve plans until shutdown. Returns the process exit code.
    `tracing`: rank 0 sends a span per step (None: tracing off). `kv_addr`: where this
    (prefill) worker serves leased KV; every single-rank worker can pull KV
    (services/worker/kv_transfer.py)."""
    stop = _stop_on_signals(log)
    if parallel.world_size > 1:
        try:
            check_model_divides(config.model, parallel.world_size)
        except ValueError as exc:
            log.error("bad_worker_config", message=str(exc))
            return EXIT_BAD_CONFIG
    # Imported here so `--help` and config errors answer without loading torch.
    from services.worker.kv_ranks import make_kv_transfer
    from services.worker.runner import ModelRunner

    log.info("loading_model", model=config.model, dtype=config.dtype, device=config.device,
             rank=parallel.rank, world_size=parallel.world_size)  # fmt: skip
    try:
        runner = ModelRunner(config, log=log, parallel=parallel)
    except ValueError as exc:  # a config the model cannot honour (documented by ModelRunner)
        log.error("bad_worker_config", message=str(exc))
        return EXIT_BAD_CONFIG
    except FatalWorkerError as exc:  # torch.distributed: the group did not form in time
        log.error("worker_group_join_failed", message=str(exc), exit_code=EXIT_GROUP_LOST)
        return EXIT_GROUP_LOST
    if stop.is_set():
        return 0
    log.info("worker_pipeline", pipeline_steps=config.pipeline_steps, on=runner.pipelining)
    kv = make_kv_transfer(runner, parallel, log, kv_addr, curve_keys, kv_pull_timeout_s)
    if kv is None:  # a rank was lost while the ranks gathered their KV endpoints
        return EXIT_GROUP_LOST
    code = serve_worker(
        runner,
        plan_address,
        parallel.rank,
        log,
        stop=stop,
        ready_file=ready_file,
        max_frame_bytes=max_frame_bytes,
        curve_keys=curve_keys,
        pipeline=runner.pipelining,
        trace=StepTrace(tracing) if tracing is not None and parallel.rank == 0 else None,
        kv=kv,
    )
    kv.close()
    if code == 0:  # a broken group is not torn down: a collective on it could block
        runner.close()
    return code


def _stop_on_signals(log: Any) -> threading.Event:
    """An event SIGTERM and SIGINT set (the loop finishes its step, then exits)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        log.info("signal", signum=signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop
