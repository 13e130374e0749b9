"""The tokenizer service's settings: flags, else CONVEYOR_* variables, else defaults."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from services.tokenizer.router import POLICIES, RouterConfig
from shared.addresses import DEFAULT_FRONTEND_ADDR, DEFAULT_SCHEDULER_ADDR
from shared.curve import check_frontend_keys, check_server_keys
from shared.env import (
    add_drain_flag,
    add_log_flags,
    env_float,
    env_int,
    env_list,
    env_path,
    env_str,
)
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES

DEFAULT_HARD_CAP_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    frontend_address: str = DEFAULT_FRONTEND_ADDR  # ROUTER for clients (bound)
    # the schedulers' ROUTERs (connected), one per engine; engine i is the i-th address
    scheduler_addresses: tuple[str, ...] = (DEFAULT_SCHEDULER_ADDR,)
    frontend_id: str = field(default_factory=lambda: f"fe-{uuid.uuid4().hex[:8]}")  # in rids
    model: Optional[str] = None  # for shared.model_files.prepare_model
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # answered with frame_too_large above
    hard_cap_bytes: int = DEFAULT_HARD_CAP_BYTES  # zmq.MAXMSGSIZE: the peer is dropped above
    heartbeat_s: float = 1.0  # FrontendHello and client heartbeats
    scheduler_timeout_s: float = 10.0  # scheduler silence before it counts as lost
    stats_timeout_s: float = 2.0  # wait for the scheduler's StatsReply
    drain_timeout_s: float = 30.0  # SIGTERM grace for in-flight requests
    send_hwm: int = 100_000  # queued frames per client before it counts as gone
    # Fairness: requests one connection may have in flight (0: no cap); past it `overloaded`.
    # Connections whose routing id starts with `cap_exempt_prefix` (the gateway's, which
    # applies the cap per API key / client address itself) are exempt. Without CURVE the
    # routing id is not authenticated: the exemption is advisory (docs/protocol.md).
    max_requests_per_connection: int = 1024
    cap_exempt_prefix: str = "gateway-"
    curve_keys: Optional[Path] = None  # `conveyor keys generate`: CURVE on both sockets
    # which engine gets a request (services/tokenizer/router.py); "auto": cache-aware while
    # the engines report prefix caching on, else least-load
    router: RouterConfig = field(default_factory=RouterConfig)

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
        for name in ("heartbeat_s", "scheduler_timeout_s", "stats_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.send_hwm <= 0:
            raise ValueError("send_hwm must be > 0")
        if self.max_requests_per_connection < 0:
            raise ValueError("max_requests_per_connection must be >= 0 (0: no cap)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.tokenizer",
        description="Conveyor's frontend: client protocol (docs/protocol.md), tokenization, "
        "detokenization, stop strings.",
    )
    p.add_argument(
        "--frontend-addr",
        default=env_str("FRONTEND_ADDR", DEFAULT_FRONTEND_ADDR),
        help="bind address for clients (CONVEYOR_FRONTEND_ADDR)",
    )
    p.add_argument(
        "--scheduler-addr",
        action="append",
        dest="scheduler_addrs",
        help="a scheduler's address; repeat it for several engines (data parallelism): engine "
        "i is the i-th (CONVEYOR_SCHEDULER_ADDRS, comma-separated, else CONVEYOR_SCHEDULER_ADDR)",
    )
    p.add_argument(
        "--router-policy",
        choices=("auto", *POLICIES),
        default=env_str("ROUTER_POLICY", "auto"),
        help="which engine gets a request: auto (cache-aware while the engines cache prefixes, "
        "else least-load), round-robin, least-load, cache-aware (CONVEYOR_ROUTER_POLICY)",
    )
    p.add_argument(
        "--router-balance-abs",
        type=int,
        default=env_int("ROUTER_BALANCE_ABS", 32),
        help="cache-aware: a prefix's engine is overloaded (least-load decides) once it carries "
        "this many requests more than the least loaded engine and --router-balance-rel times "
        "as many (CONVEYOR_ROUTER_BALANCE_ABS)",
    )
    p.add_argument(
        "--router-balance-rel",
        type=float,
        default=env_float("ROUTER_BALANCE_REL", 1.5),
        help="cache-aware: see --router-balance-abs (CONVEYOR_ROUTER_BALANCE_REL)",
    )
    p.add_argument(
        "--frontend-id",
        default=env_str("FRONTEND_ID", ""),
        help="this frontend's id, unique per engine (CONVEYOR_FRONTEND_ID; default random)",
    )
    p.add_argument(
        "--model",
        default=env_str("MODEL"),
        help="'smollm2' (default), a .gguf file or an HF folder (CONVEYOR_MODEL)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=int,
        default=env_int("MAX_FRAME_BYTES", DEFAULT_MAX_FRAME_BYTES),
        help="larger client frames get frame_too_large (CONVEYOR_MAX_FRAME_BYTES)",
    )
    p.add_argument(
        "--hard-cap-bytes",
        type=int,
        default=env_int("HARD_CAP_BYTES", DEFAULT_HARD_CAP_BYTES),
        help="zmq.MAXMSGSIZE: larger frames drop the peer (CONVEYOR_HARD_CAP_BYTES)",
    )
    add_drain_flag(p)
    p.add_argument(
        "--scheduler-timeout",
        type=float,
        default=env_float("SCHEDULER_TIMEOUT", 10.0),
        help="seconds of scheduler silence before in-flight requests fail with "
        "engine_unreachable (CONVEYOR_SCHEDULER_TIMEOUT)",
    )
    p.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=env_int("MAX_REQUESTS_PER_CONNECTION", 1024),
        help="requests one connection may have in flight, past it overloaded; 0: no cap "
        "(CONVEYOR_MAX_REQUESTS_PER_CONNECTION)",
    )
    p.add_argument(
        "--curve-keys",
        type=Path,
        default=env_path("CURVE_KEYS"),
        help="CURVE on the client socket (server key pair + authorized_clients/) and to the "
        "scheduler (frontend.key_secret): the folder of `conveyor keys generate`; without it "
        "clients are not authenticated (CONVEYOR_CURVE_KEYS)",
    )
    add_log_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """Raises ValueError on an invalid combination."""
    frontend_id = args.frontend_id or f"fe-{uuid.uuid4().hex[:8]}"
    if args.curve_keys is not None:
        check_server_keys(args.curve_keys)
        check_frontend_keys(args.curve_keys)  # and CURVE to the scheduler
    return FrontendConfig(
        frontend_address=args.frontend_addr,
        scheduler_addresses=tuple(scheduler_addresses(args.scheduler_addrs)),
        frontend_id=frontend_id,
        model=args.model,
        max_frame_bytes=args.max_frame_bytes,
        hard_cap_bytes=max(args.hard_cap_bytes, args.max_frame_bytes),
        drain_timeout_s=args.drain_timeout,
        scheduler_timeout_s=args.scheduler_timeout,
        max_requests_per_connection=args.max_requests_per_connection,
        curve_keys=args.curve_keys,
        router=RouterConfig(args.router_policy, args.router_balance_abs, args.router_balance_rel),
    )


def scheduler_addresses(flags: Optional[list[str]]) -> list[str]:
    """The engines' scheduler addresses: the flags, else CONVEYOR_SCHEDULER_ADDRS, else
    CONVEYOR_SCHEDULER_ADDR, else the default."""
    if flags:
        return flags
    listed = env_list("SCHEDULER_ADDRS")
    if listed:
        return listed
    return [env_str("SCHEDULER_ADDR", DEFAULT_SCHEDULER_ADDR) or DEFAULT_SCHEDULER_ADDR]
