"""The gateway's settings: flags, else CONVEYOR_* variables, else defaults (every flag generated
from GatewayConfig and LogConfig: shared/config_flags.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from services.gateway.api_keys import ApiKeys
from shared.addresses import DEFAULT_FRONTEND_ADDR, DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT
from shared.config_flags import add_config_flags, config_from_args
from shared.curve import check_client_keys
from shared.env import LogConfig, env_str
from shared.model_files import DEFAULT_MODEL
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES

DEFAULT_ENGINE_ADDR = DEFAULT_FRONTEND_ADDR  # the tokenizer service the gateway talks to


def default_model_name() -> str:
    """The name of CONVEYOR_MODEL as users would write it: 'smollm2', or a file/folder stem."""
    spec = env_str("MODEL", DEFAULT_MODEL) or DEFAULT_MODEL
    return Path(spec).stem if spec.endswith(".gguf") else Path(spec).name or DEFAULT_MODEL


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    # the tokenizer service's client-facing address; `--frontend-addr` is its other spelling
    engine_addr: str = field(
        default=DEFAULT_ENGINE_ADDR,
        metadata={"env": "FRONTEND_ADDR", "aliases": ("--frontend-addr",),
                  "help": "the frontend (tokenizer service) address"},
    )  # fmt: skip
    # resumption (docs/design/resumption.md): a lost frontend's open streams go on at the next
    # address in turn (or at the same one, restarted), from the tokens they have
    more_frontend_addrs: tuple[str, ...] = field(
        default=(),
        metadata={"help": "more frontends, tried in turn when the one in use is lost (repeat "
                  "the flag or separate them by commas)"},
    )  # fmt: skip
    frontend_resume_timeout_s: float = field(
        default=30.0,
        metadata={"help": "seconds to look for a frontend after the one in use was lost, "
                  "before its open requests fail (0: no resumption)"},
    )  # fmt: skip
    http_host: str = field(
        default=DEFAULT_HTTP_HOST,
        metadata={"aliases": ("--host",), "help": "address the HTTP API listens on"},
    )
    http_port: int = field(
        default=DEFAULT_HTTP_PORT,
        metadata={"aliases": ("--port",), "help": "port the HTTP API listens on"},
    )
    api_key: Optional[str] = field(
        default=None,  # None: no authentication
        metadata={"help": "require 'Authorization: Bearer KEY' on /v1/*"},
    )
    # several keys, each with the latency-target class its requests get (services/gateway/
    # api_keys.py): one team's dashboard interactive, another's nightly jobs batch
    api_key_file: Optional[Path] = field(
        default=None,
        metadata={"help": "accept the API keys in this file, one per line: KEY [SLO_CLASS] "
                  "(the engine latency-target class of the key's requests that name none)"},
    )  # fmt: skip
    served_model_name: str = field(
        default_factory=default_model_name,  # the `model` clients send and /v1/models lists
        metadata={"default_text": "the name of CONVEYOR_MODEL", "help": "model name clients use"},
    )
    max_choices: int = field(default=16, metadata={"help": "prompts x n per HTTP request"})
    default_max_tokens: Optional[int] = field(
        default=None,  # None: the engine's default (16)
        metadata={"help": "max_tokens when a request gives none (none: the engine's)"},
    )
    # Silence tolerated from the frontend. It heartbeats every second while a request is in
    # flight (docs/protocol.md), so this only bounds how long a dead frontend goes unnoticed.
    engine_timeout_s: float = field(
        default=20.0, metadata={"help": "seconds of engine silence before a request fails"}
    )
    stats_interval_s: float = field(
        default=2.0,  # how often /metrics' engine gauges are refreshed
        metadata={"help": "seconds between engine stats polls"},
    )
    max_body_bytes: int = field(
        default=1 << 20, metadata={"help": "larger request bodies get 413 request_too_large"}
    )
    # Fairness: engine requests one API key (or, without keys, one client address) may have in
    # flight; past it 429 overloaded. The gateway's own engine connection is exempt from the
    # frontend's per-connection cap, since all its users share it. 0: no cap.
    max_requests_per_client: int = field(
        default=1024,
        metadata={"help": "engine requests in flight per API key / client address; 0: no cap"},
    )
    # Engine frames above this are refused here (413 frame_too_large) and never sent: all users
    # share one frontend connection, which a frame over its hard cap would drop.
    max_frame_bytes: int = field(
        default=DEFAULT_MAX_FRAME_BYTES,
        metadata={"help": "the frontend's frame limit; larger requests get 413"},
    )
    # CURVE to the frontend (shared/curve.py): its public key file and this gateway's key pair
    server_key: Optional[Path] = field(
        default=None,
        metadata={"help": "CURVE: the frontend's public key file (DIR/server.key)"},
    )
    client_key: Optional[Path] = field(
        default=None,
        metadata={"help": "CURVE: this client's key pair file (DIR/client.key_secret)"},
    )

    def __post_init__(self) -> None:
        if not self.engine_addr:
            raise ValueError("engine_addr must not be empty")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it out to disable authentication)")
        if self.api_key_file is not None:
            try:
                ApiKeys.load(self.api_key, self.api_key_file)  # a bad file stops the start
            except OSError as e:
                raise ValueError(f"api_key_file: {e}") from None
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
        if self.frontend_resume_timeout_s < 0 or not all(self.more_frontend_addrs):
            raise ValueError("frontend_resume_timeout_s must be >= 0, frontend addresses set")
        if self.engine_timeout_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("engine_timeout_s and stats_interval_s must be > 0")

    @property
    def requires_key(self) -> bool:
        """Whether /v1/* asks for an API key (`--api-key` or `--api-key-file`)."""
        return self.api_key is not None or self.api_key_file is not None


CONFIGS = (GatewayConfig, LogConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.gateway", description="OpenAI-compatible HTTP gateway"
    )
    for cls in CONFIGS:
        add_config_flags(p, cls)
    return p


def parse_args(argv: Optional[list[str]] = None) -> tuple[GatewayConfig, LogConfig]:
    """Command line -> the settings; a bad value exits with the parser's usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config, logs = (config_from_args(parser, args, cls) for cls in CONFIGS)
    try:
        check_client_keys(config.server_key, config.client_key)
    except ValueError as exc:
        parser.error(str(exc))
    return config, logs
