"""A worker process's link to its scheduler: the settings the real and the simulated worker
share (every field is a flag and a CONVEYOR_* variable: shared/config_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shared.addresses import DEFAULT_WORKER_ADDR


@dataclass(frozen=True, slots=True)
class WorkerProcessConfig:
    worker_addr: str = field(
        default=DEFAULT_WORKER_ADDR,
        metadata={"aliases": ("--plan-addr",),
                  "help": "the scheduler's worker address to connect to"},
    )  # fmt: skip
    ready_file: Optional[Path] = field(
        default=None,
        metadata={"help": "created once ready, removed on exit (container healthchecks)"},
    )
    # Internal frames only: not CONVEYOR_MAX_FRAME_BYTES, which limits clients' frames.
    max_frame_bytes: Optional[int] = field(
        default=None,
        metadata={"env": None, "help": "larger plans get a WorkerFailure (none: no limit)"},
    )
    curve_keys: Optional[Path] = field(
        default=None,
        metadata={"help": "CURVE to the scheduler: the folder of `conveyor keys generate` "
                  "(server.key and worker.key_secret)"},
    )  # fmt: skip
    # disaggregation (docs/design/disaggregation.md): the launcher sets kv_addr on prefill engines
    kv_addr: Optional[str] = field(
        default=None,
        metadata={"help": "bind address where decode workers pull this worker's leased KV "
                  "blocks (a prefill engine's worker; none: serves no KV)"},
    )  # fmt: skip
    kv_pull_timeout_s: float = field(
        default=1.0,
        metadata={"help": "seconds a decode worker waits for a prefill worker's KV before "
                  "its scheduler recomputes the prompt instead (under the lease time-out)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.kv_pull_timeout_s <= 0:
            raise ValueError("kv_pull_timeout_s must be > 0")
        if not self.worker_addr:
            raise ValueError("worker_addr must not be empty")
        if self.max_frame_bytes is not None and self.max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0 (or none: no limit)")
