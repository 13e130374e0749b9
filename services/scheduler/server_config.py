"""The scheduler process's settings and what its loop needs of the core (server.py).

`ServerConfig` holds the socket-side settings (addresses, frame limits, time-outs, fault
handling); the core's own settings are services.scheduler.config.SchedulerConfig.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from services.scheduler.config import SchedulerConfig
from services.scheduler.inflight import InFlightSteps
from shared.protocol.engine_channel import (
    OutputBatch,
    RequestOutput,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.worker_channel import StepPlan, StepResult, WorkerReady


class SchedulerCore(Protocol):
    """The parts of services.scheduler.Scheduler this loop uses (docs/design/contracts.md)."""

    config: SchedulerConfig
    in_flight: InFlightSteps  # the one record of plans in flight: the loop reads it

    def add_request(self, req: SubmitRequest) -> Optional[RequestRejected]: ...
    def abort_request(self, rid: str, reason: str = "abort") -> Optional[RequestOutput]: ...
    def can_schedule(self) -> bool: ...
    def schedule(self) -> Optional[StepPlan]: ...
    def update(self, result: StepResult) -> OutputBatch: ...
    def fail_all(self, code: str, message: str) -> list[RequestOutput]: ...
    def bisect_failed_step(self, code: str, message: str) -> list[RequestOutput]: ...
    def step_completed(self, rids: list[str]) -> None: ...
    def release_held_if_idle(self) -> None: ...
    def requeue_all(self, max_retries: int, code: str, message: str) -> list[RequestOutput]: ...
    def next_timeout(self) -> Optional[float]: ...
    def stats(self) -> dict[str, float]: ...
    def reset_prefix_cache(self) -> int: ...
    def after_plan(self) -> None: ...


# Builds the core once the worker handshake says how big the KV pool is.
SchedulerFactory = Callable[[WorkerReady], SchedulerCore]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    frontend_address: str
    worker_address: str
    num_workers: int = 1  # ranks that must say WorkerReady before requests are admitted
    max_frame_bytes: int = 16 << 20  # larger frames from a frontend are dropped with a log line
    hard_max_frame_bytes: int = 256 << 20  # zmq.MAXMSGSIZE: the peer is disconnected
    frontend_timeout_s: float = 10.0  # silent this long (it beats every 1 s): gone
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    summary_interval_s: float = 5.0  # an engine_summary log line this often while busy; 0: off
    max_retries: int = 3  # restarts by recompute per request after worker losses
    requeue_timeout_s: float = 30.0  # requeued requests wait this long for a worker
    # `conveyor keys generate` folder: CURVE on the worker socket (authorized_workers/ only) and
    # the frontend socket (authorized_frontends/ only)
    curve_keys: Optional[Path] = None

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.requeue_timeout_s <= 0:
            raise ValueError("max_retries must be >= 0 and requeue_timeout_s > 0")
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if not 0 < self.max_frame_bytes <= self.hard_max_frame_bytes:
            raise ValueError("need 0 < max_frame_bytes <= hard_max_frame_bytes")
        if self.frontend_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("frontend_timeout_s must be > 0 and drain_timeout_s >= 0")
        if self.summary_interval_s < 0:
            raise ValueError("summary_interval_s must be >= 0 (0 turns the summary off)")
