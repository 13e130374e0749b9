"""The gateway's settings: flags, else CONVEYOR_* variables (shared/env.py), else defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from shared.addresses import DEFAULT_FRONTEND_ADDR, DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT
from shared.console_format import LOG_FORMATS
from shared.curve import add_client_key_flags, check_client_keys
from shared.env import add_log_format_flag, env_float, env_int, env_str
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES

DEFAULT_ENGINE_ADDR = DEFAULT_FRONTEND_ADDR  # the tokenizer service the gateway talks to


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    engine_addr: str = DEFAULT_ENGINE_ADDR  # the tokenizer service's client-facing address
    http_host: str = DEFAULT_HTTP_HOST
    http_port: int = DEFAULT_HTTP_PORT
    api_key: Optional[str] = None  # None: no authentication
    served_model_name: str = "smollm2"  # the `model` clients send and /v1/models lists
    max_choices: int = 16  # prompts x n per HTTP request
    default_max_tokens: Optional[int] = None  # None: the engine's default (16)
    # Silence tolerated from the frontend. It heartbeats every second while a request is in
    # flight (docs/protocol.md), so this only bounds how long a dead frontend goes unnoticed.
    engine_timeout_s: float = 20.0
    stats_interval_s: float = 2.0  # how often /metrics' engine gauges are refreshed
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 request_too_large
    # Fairness: engine requests one API key (or, without keys, one client address) may have in
    # flight; past it 429 overloaded. The gateway's own engine connection is exempt from the
    # frontend's per-connection cap, since all its users share it. 0: no cap.
    max_requests_per_client: int = 1024
    # Engine frames above this are refused here (413 frame_too_large) and never sent: all users
    # share one frontend connection, which a frame over its hard cap would drop.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    log_level: str = "info"
    log_file: Optional[Path] = None
    log_format: str = "auto"  # stdout: console | json | auto (files are always JSON)
    # CURVE to the frontend (shared/curve.py): its public key file and this gateway's key pair
    server_key: Optional[Path] = None
    client_key: Optional[Path] = None

    def __post_init__(self) -> None:
        if not self.engine_addr:
            raise ValueError("engine_addr must not be empty")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it out to disable authentication)")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_choices < 1:
            raise ValueError("max_choices must be >= 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.max_requests_per_client < 0:
            raise ValueError("max_requests_per_client must be >= 0 (0: no cap)")
        if self.max_body_bytes < 1 or self.max_frame_bytes < 1:
            raise ValueError("max_body_bytes and max_frame_bytes must be >= 1")
        if self.engine_timeout_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("engine_timeout_s and stats_interval_s must be > 0")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")


def default_model_name() -> str:
    """The name of CONVEYOR_MODEL as users would write it: 'smollm2', or a file/folder stem."""
    spec = env_str("MODEL", "smollm2") or "smollm2"
    return Path(spec).stem if spec.endswith(".gguf") else Path(spec).name or "smollm2"


def parse_args(argv: Optional[list[str]] = None) -> GatewayConfig:
    """Command line -> GatewayConfig; a bad value exits with the parser's usage message."""
    p = argparse.ArgumentParser(
        prog="python -m services.gateway", description="OpenAI-compatible HTTP gateway"
    )
    # The second spellings are the ones `conveyor up` (conveyor/launcher.py) passes.
    p.add_argument(
        "--engine-addr",
        "--frontend-addr",
        dest="engine_addr",
        default=env_str("FRONTEND_ADDR", DEFAULT_ENGINE_ADDR),
        help="frontend (tokenizer service) address [CONVEYOR_FRONTEND_ADDR]",
    )
    p.add_argument(
        "--http-host",
        "--host",
        dest="http_host",
        default=env_str("HTTP_HOST", DEFAULT_HTTP_HOST),
        help="[CONVEYOR_HTTP_HOST]",
    )
    p.add_argument(
        "--http-port",
        "--port",
        dest="http_port",
        type=int,
        default=env_int("HTTP_PORT", DEFAULT_HTTP_PORT),
        help="[CONVEYOR_HTTP_PORT]",
    )
    p.add_argument(
        "--api-key",
        default=env_str("API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* [CONVEYOR_API_KEY]",
    )
    p.add_argument(
        "--served-model-name",
        default=env_str("SERVED_MODEL_NAME"),
        help="model name clients use [CONVEYOR_SERVED_MODEL_NAME]",
    )
    p.add_argument("--max-choices", type=int, default=16, help="prompts x n per request")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens when a request gives none (default: the engine's)",
    )
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=20.0,
        help="seconds of engine silence before a request fails",
    )
    p.add_argument(
        "--stats-interval",
        type=float,
        default=env_float("STATS_INTERVAL", 2.0),
        help="seconds between engine stats polls [CONVEYOR_STATS_INTERVAL]",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=env_int("MAX_BODY_BYTES", 1 << 20),
        help="larger request bodies get 413 [CONVEYOR_MAX_BODY_BYTES]",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=int,
        default=env_int("MAX_FRAME_BYTES", DEFAULT_MAX_FRAME_BYTES),
        help="the frontend's frame limit; larger requests get 413 [CONVEYOR_MAX_FRAME_BYTES]",
    )
    p.add_argument(
        "--max-requests-per-client",
        type=int,
        default=env_int("MAX_REQUESTS_PER_CLIENT", 1024),
        help="engine requests in flight per API key / client address; 0: no cap "
        "[CONVEYOR_MAX_REQUESTS_PER_CLIENT]",
    )
    p.add_argument("--log-level", default=env_str("LOG_LEVEL", "info"))
    add_log_format_flag(p)
    p.add_argument(
        "--log-file", default=env_str("LOG_FILE"), help="also log there [CONVEYOR_LOG_FILE]"
    )
    add_client_key_flags(p)
    a = p.parse_args(argv)
    try:
        check_client_keys(a.server_key, a.client_key)
        return GatewayConfig(
            engine_addr=a.engine_addr,
            http_host=a.http_host,
            http_port=a.http_port,
            api_key=a.api_key,
            served_model_name=a.served_model_name or default_model_name(),
            max_choices=a.max_choices,
            default_max_tokens=a.default_max_tokens,
            engine_timeout_s=a.engine_timeout,
            stats_interval_s=a.stats_interval,
            max_body_bytes=a.max_body_bytes,
            max_frame_bytes=a.max_frame_bytes,
            max_requests_per_client=a.max_requests_per_client,
            log_level=a.log_level,
            log_file=Path(a.log_file) if a.log_file else None,
            log_format=a.log_format,
            server_key=a.server_key,
            client_key=a.client_key,
        )
    except ValueError as exc:
        p.error(str(exc))
