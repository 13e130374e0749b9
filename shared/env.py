"""The CONVEYOR_* environment, and the settings every service shares.

Each config field of every service is a flag and a CONVEYOR_<FLAG> variable, generated from its
dataclass (shared/config_flags.py; all listed in docs/cli.md): a flag beats the environment,
which beats the dataclass default. `KNOWN` lists the few variables that are not a config field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from shared.console_format import LOG_FORMATS, LogFormat

PREFIX = "CONVEYOR_"

# SIGTERM grace period, seconds, of the services that hold requests (scheduler, tokenizer) and
# of the launcher that stops them: in-flight requests get this long to finish.
DRAIN_TIMEOUT_S = 30.0

# name (without prefix) -> what it sets; the variables that are no config field's
KNOWN: dict[str, str] = {
    "CACHE_DIR": "where converted models are cached (default ~/.cache/conveyor)",
    "ENGINE": "scheduler/worker: the engine's name, added as `engine` to every log line "
    "(conveyor up sets it per engine)",
    "SERVER_KEY": "client commands (generate, chat, stats, top) and healthchecks: the CURVE "
    "server public key file (DIR/server.key); the gateway's --server-key",
    "CLIENT_KEY": "client commands and healthchecks: the CURVE client key pair file "
    "(DIR/client.key_secret); the gateway's --client-key",
    "AUTO_DTYPE": "worker: what --dtype auto becomes on CPU (float32 | bfloat16), instead of "
    "the GEMM probe's choice (tests pin it to run the suite as another CPU would)",
    "HEAP_TRIM": "worker: give freed heap back to the OS when idle (default 1; 0 keeps glibc's "
    "caches, as bench/soak.py --compare-untrimmed does)",
}


@dataclass(frozen=True, slots=True)
class LogConfig:
    """The log and trace settings every service takes (shared/logging.py, shared/tracing.py)."""

    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    log_file: Optional[Path] = field(
        default=None,
        metadata={"help": "also write the JSON lines there (the launcher: logs/<service>.log)"},
    )
    log_format: LogFormat = field(
        default="auto",
        metadata={"help": "stdout: console lines, JSON lines, or auto (console on a terminal); "
                  "log files are JSON whatever it says"},
    )  # fmt: skip
    otlp_endpoint: Optional[str] = field(
        default=None,
        metadata={"help": "OpenTelemetry traces go there over OTLP/HTTP, host[:port] (port 4318 "
                  "when none) or a URL; else OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
        if not self.log_level:
            raise ValueError("log_level must not be empty")


def env_str(name: str, default: Optional[str] = None) -> Optional[str]:
    """CONVEYOR_<name>, or `default` when unset or empty."""
    value = os.environ.get(PREFIX + name)
    return value if value else default


def env_int(name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={raw!r} is not an integer") from None


def env_bool(name: str, default: bool = False) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={raw!r} is not a boolean")


def env_path(name: str) -> Optional[Path]:
    """CONVEYOR_<name> as a Path, or None when unset or empty."""
    raw = env_str(name)
    return Path(raw) if raw else None
