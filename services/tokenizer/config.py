"""The tokenizer service's settings: flags, else CONVEYOR_* variables, else defaults (every
flag generated from FrontendConfig and LogConfig: shared/config_flags.py)."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from services.tokenizer.router import RouterConfig
from shared.addresses import DEFAULT_FRONTEND_ADDR, DEFAULT_SCHEDULER_ADDR
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import check_frontend_keys, check_server_keys
from shared.env import DRAIN_TIMEOUT_S, LogConfig
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES

__all__ = [
    "DEFAULT_FRONTEND_ADDR",
    "FrontendConfig",
    "build_parser",
    "new_frontend_id",
    "parse_args",
]

DEFAULT_HARD_CAP_BYTES = 64 << 20


def new_frontend_id() -> str:
    """A fresh random frontend id (request ids embed it)."""
    return f"fe-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    frontend_address: str = field(
        default=DEFAULT_FRONTEND_ADDR,  # ROUTER for clients (bound)
        metadata={"flag": "frontend_addr", "help": "bind address for clients"},
    )
    # the schedulers' ROUTERs (connected), one per engine; engine i is the i-th address
    scheduler_addresses: tuple[str, ...] = field(
        default=(DEFAULT_SCHEDULER_ADDR,),
        metadata={"flag": "scheduler_addr", "env": ("SCHEDULER_ADDRS", "SCHEDULER_ADDR"),
                  "help": "the schedulers' addresses, one per engine (data parallelism): engine "
                  "i is the i-th; repeat the flag or separate them by commas"},
    )  # fmt: skip
    frontend_id: str = field(
        default_factory=new_frontend_id,  # in rids
        metadata={"default_text": "fe- and 8 random hex digits",
                  "help": "this frontend's id, unique per engine (request ids embed it)"},
    )  # fmt: skip
    model: Optional[str] = field(
        default=None,  # for shared.model_files.prepare_model
        metadata={"help": "'smollm2' (none: the default), a .gguf file or a Hugging Face folder"},
    )
    max_frame_bytes: int = field(
        default=DEFAULT_MAX_FRAME_BYTES,
        metadata={"help": "larger client frames are answered with frame_too_large"},
    )
    hard_cap_bytes: int = field(
        default=DEFAULT_HARD_CAP_BYTES,
        metadata={"help": "zmq.MAXMSGSIZE: larger frames drop the peer (raised to "
                  "max_frame_bytes when below it)"},
    )  # fmt: skip
    heartbeat_s: float = field(
        default=1.0,
        metadata={"internal": True, "help": "seconds between FrontendHello and client heartbeats"},
    )
    scheduler_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds of scheduler silence before its engine counts as lost (its "
                  "requests resume on another engine, or wait for one)"},
    )  # fmt: skip
    # Resumption (docs/design/resumption.md): a request whose engine is lost, drained or
    # refuses it goes on elsewhere from the tokens it has.
    max_resumes: int = field(
        default=3,
        metadata={"help": "times one request may resume after its engine was lost or refused "
                  "it; past it engine_unreachable"},
    )  # fmt: skip
    resume_timeout_s: float = field(
        default=30.0,
        metadata={"help": "seconds a request whose engine was lost waits for an engine to take "
                  "it (a restarted or another one) before engine_unreachable"},
    )  # fmt: skip
    stats_timeout_s: float = field(
        default=2.0, metadata={"internal": True, "help": "wait for the scheduler's StatsReply"}
    )
    drain_timeout_s: float = field(
        default=DRAIN_TIMEOUT_S,
        metadata={"help": "SIGTERM grace period for in-flight requests, seconds"},
    )
    send_hwm: int = field(
        default=100_000,
        metadata={"internal": True, "help": "queued frames per client before it counts as gone"},
    )
    # Fairness: requests one connection may have in flight (0: no cap); past it `overloaded`.
    # Connections whose routing id starts with `cap_exempt_prefix` (the gateway's, which
    # applies the cap per API key / client address itself) are exempt. Without CURVE the
    # routing id is not authenticated: the exemption is advisory (docs/protocol.md).
    max_requests_per_connection: int = field(
        default=1024,
        metadata={"help": "requests one connection may have in flight, past it overloaded; "
                  "0: no cap"},
    )  # fmt: skip
    cap_exempt_prefix: str = field(
        default="gateway-",
        metadata={"internal": True, "help": "connections whose routing id starts so are exempt "
                  "from --max-requests-per-connection"},
    )  # fmt: skip
    curve_keys: Optional[Path] = field(
        default=None,
        metadata={"help": "CURVE on the client socket (server key pair + authorized_clients/) "
                  "and to the scheduler (frontend.key_secret): the folder of `conveyor keys "
                  "generate`; without it clients are not authenticated"},
    )  # fmt: skip
    # which engine gets a request (services/tokenizer/router.py); "auto": cache-aware while
    # the engines report prefix caching on, else least-load
    router: RouterConfig = field(default_factory=RouterConfig, metadata={"prefix": "router_"})

    def __post_init__(self) -> None:
        if not self.frontend_address or not self.scheduler_addresses:
            raise ValueError("frontend and scheduler addresses must be set")
        if not all(self.scheduler_addresses):
            raise ValueError("a scheduler address must not be empty")
        if len(set(self.scheduler_addresses)) != len(self.scheduler_addresses):
            raise ValueError("each scheduler address may be given once")
        if not self.frontend_id:
            raise ValueError("frontend_id must not be empty")
        if self.max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be > 0")
        if self.hard_cap_bytes < self.max_frame_bytes:
            raise ValueError("the hard cap must be >= max_frame_bytes")
        if self.max_resumes < 0:
            raise ValueError("max_resumes must be >= 0")
        for name in ("heartbeat_s", "scheduler_timeout_s", "stats_timeout_s", "resume_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.send_hwm <= 0:
            raise ValueError("send_hwm must be > 0")
        if self.max_requests_per_connection < 0:
            raise ValueError("max_requests_per_connection must be >= 0 (0: no cap)")

    @classmethod
    def from_flags(cls, **values: Any) -> FrontendConfig:
        """From flags or variables: a frame limit above the hard cap raises the cap."""
        limit = values.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES)
        values["hard_cap_bytes"] = max(values.get("hard_cap_bytes", DEFAULT_HARD_CAP_BYTES), limit)
        return cls(**values)


CONFIGS = (FrontendConfig, LogConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.tokenizer",
        description="Conveyor's frontend: client protocol (docs/protocol.md), tokenization, "
        "detokenization, stop strings.",
    )
    for cls in CONFIGS:
        add_config_flags(p, cls)
    return p


def parse_args(argv: Optional[list[str]] = None) -> tuple[FrontendConfig, LogConfig]:
    """Command line (else CONVEYOR_* variables) -> the settings; a bad value, or a CURVE folder
    without the keys it needs, exits with the parser's usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config, logs = (config_from_args(parser, args, cls) for cls in CONFIGS)
    if config.curve_keys is not None:
        try:
            check_server_keys(config.curve_keys)
            check_frontend_keys(config.curve_keys)  # and CURVE to the scheduler
        except ValueError as exc:
            parser.error(str(exc))
    return config, logs
