"""Per-service structured logs: structlog records, JSON lines rendered with orjson.

Every record carries `service` and `event`; request-related ones carry `rid`; the records of
an engine's services (scheduler, worker) carry `engine` when CONVEYOR_ENGINE names it. Log files
(`--log-file`, or `logs/<service>.log` under the local launcher) always get the JSON line; stdout
gets it too, or with `--log-format console` (and `auto` on a terminal) a short human line
(shared/console_format.py). Under `conveyor up` stdout is a pipe, so the services write JSON and
the launcher renders the console lines itself.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional, TextIO

import orjson
import structlog

from shared.console_format import LOG_FORMATS, render
from shared.env import env_str


class _TeeWriter:
    """Structlog's logger: writes each record to stdout (JSON or console) and, optionally, to a
    log file (always JSON)."""

    def __init__(self, stream: TextIO, path: Optional[Path], console: bool) -> None:
        self._stream = stream
        self._console = console
        self._colour = console and _isatty(stream)
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process

    def msg(self, record: dict[str, Any]) -> None:
        line = _dumps(record) + b"\n"
        shown = (render(record, self._colour) + "\n").encode() if self._console else line
        try:
            self._stream.buffer.write(shown)
            self._stream.flush()
        except (ValueError, OSError):  # stdout closed (launcher gone): keep the file log
            pass
        if self._file is not None:
            self._file.write(line)

    log = debug = info = warning = warn = error = critical = exception = msg


def resolve_log_format(log_format: str, stream: TextIO) -> str:
    """'console' or 'json': `auto` is console on a terminal, JSON otherwise (pipes, compose,
    log collectors). Raises ValueError on an unknown format."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    if log_format == "auto":
        return "console" if _isatty(stream) else "json"
    return log_format


def configure_logging(
    service: str,
    level: str = "info",
    log_file: Optional[Path] = None,
    stream: TextIO = sys.stdout,
    log_format: str = "json",
) -> structlog.BoundLogger:
    """Configure structlog for this process once, at start; returns the service's logger."""
    console = resolve_log_format(log_format, stream) == "console"
    writer = _TeeWriter(stream, log_file, console)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            _keep_record,  # the writer renders: JSON for files, JSON or console for stdout
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper()) if isinstance(level, str) else level
        ),
        logger_factory=lambda *args: writer,
        cache_logger_on_first_use=True,
    )
    log = structlog.get_logger().bind(service=service)
    # The services of one engine (scheduler, worker ranks) name it on every line, so that the
    # logs of several engines (data parallelism) stay apart: `conveyor up` sets it per engine.
    engine = env_str("ENGINE")
    return log.bind(engine=engine) if engine else log


def _keep_record(
    _logger: Any, _name: str, event_dict: dict[str, Any]
) -> tuple[tuple[dict[str, Any]], dict[str, Any]]:
    """Last processor: hand the record itself to the writer (structlog's (args, kwargs) form)."""
    return (event_dict,), {}


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _dumps(obj: Any, **_: Any) -> bytes:
    return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)
