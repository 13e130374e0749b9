"""The scheduler process's settings and what its loop needs of the core (server.py).

`ServerConfig` holds the socket-side settings (addresses, frame limits, time-outs, fault
handling); the core's own settings are services.scheduler.config.SchedulerConfig.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from services.scheduler.config import SchedulerConfig
from services.scheduler.handover import Leases, Pulls
from services.scheduler.inflight import InFlightSteps
from shared.addresses import DEFAULT_SCHEDULER_ADDR, DEFAULT_WORKER_ADDR
from shared.env import DRAIN_TIMEOUT_S
from shared.protocol.engine_channel import (
    OutputBatch,
    RequestOutput,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.worker_channel import KvPulled, StepPlan, StepResult, WorkerReady


class SchedulerCore(Protocol):
    """The parts of services.scheduler.Scheduler this loop uses (docs/design/contracts.md)."""

    config: SchedulerConfig
    in_flight: InFlightSteps  # the one record of plans in flight: the loop reads it
    leases: Leases  # a prefill engine's KV hand-overs: the loop releases, renews, expires
    pulls: Pulls  # a decode engine's: the loop takes the ended ones for their frontends

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
    def pull_done(self, msg: KvPulled) -> None: ...
    def take_worker_messages(self) -> list[Any]: ...


# Builds the core once the worker handshake says how big the KV pool is.
SchedulerFactory = Callable[[WorkerReady], SchedulerCore]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    frontend_address: str = field(
        default=DEFAULT_SCHEDULER_ADDR,
        metadata={"flag": "scheduler_addr", "help": "bind address for frontends"},
    )
    worker_address: str = field(
        default=DEFAULT_WORKER_ADDR,
        metadata={"flag": "worker_addr", "help": "bind address for the worker rank(s)"},
    )
    num_workers: int = field(
        default=1, metadata={"help": "worker ranks that must be ready before requests are admitted"}
    )
    # Larger frames from a frontend are dropped with a log line. Internal frames only: not
    # CONVEYOR_MAX_FRAME_BYTES, which limits clients' frames at the tokenizer.
    max_frame_bytes: int = field(
        default=16 << 20,
        metadata={"env": None, "help": "larger frames from a frontend are dropped"},
    )
    hard_max_frame_bytes: int = field(
        default=256 << 20,
        metadata={"internal": True, "help": "zmq.MAXMSGSIZE of the frontend socket: a larger "
                  "frame disconnects the peer"},
    )  # fmt: skip
    frontend_timeout_s: float = field(
        default=10.0,  # a frontend beats every second
        metadata={"help": "seconds of frontend silence before its requests are aborted"},
    )
    drain_timeout_s: float = field(
        default=DRAIN_TIMEOUT_S,
        metadata={"help": "SIGTERM grace period for in-flight requests, seconds"},
    )
    summary_interval_s: float = field(
        default=5.0,
        metadata={"help": "seconds between engine_summary log lines while busy; 0 turns them off"},
    )
    max_retries: int = field(
        default=3,
        metadata={"help": "restarts by recompute a request gets when the worker is lost, then "
                  "worker_failed"},
    )  # fmt: skip
    requeue_timeout_s: float = field(
        default=30.0,
        metadata={"help": "seconds requeued requests wait for a worker before worker_failed"},
    )
    # disaggregation (docs/design/disaggregation.md); `conveyor up --prefill-engines P
    # --decode-engines D` sets it per engine
    role: str = field(
        default="colocated",
        metadata={"choices": ("colocated", "prefill", "decode"),
                  "help": "what this engine does: colocated (prompts and decodes), prefill "
                  "(prompts and their first token, then hands the KV over), decode"},
    )  # fmt: skip
    curve_keys: Optional[Path] = field(
        default=None,
        metadata={"help": "CURVE on both sockets: the folder of `conveyor keys generate`; only "
                  "authorized_workers/ may connect as workers, authorized_frontends/ as "
                  "frontends"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError("role must be colocated, prefill or decode")
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
