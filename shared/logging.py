"""Per-service structured logs: structlog JSON lines rendered with orjson.

Every line carries `service` and `event`; request-related lines carry `rid`. Under the local
launcher each service also writes `logs/<service>.log` (set by `log_file`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional, TextIO

import orjson
import structlog


class _TeeWriter:
    """File-like that writes each rendered line to stdout and, optionally, a log file."""

    def __init__(self, stream: TextIO, path: Optional[Path]) -> None:
        self._stream = stream
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process

    def msg(self, message: bytes) -> None:
        line = message + b"\n"
        try:
            self._stream.buffer.write(line)
            self._stream.flush()
        except (ValueError, OSError):  # stdout closed (launcher gone): keep the file log
            pass
        if self._file is not None:
            self._file.write(line)

    log = debug = info = warning = warn = error = critical = exception = msg


def configure_logging(
    service: str, level: str = "info", log_file: Optional[Path] = None, stream: TextIO = sys.stdout
) -> structlog.BoundLogger:
    """Configure structlog for this process once, at start; returns the service's logger."""
    writer = _TeeWriter(stream, log_file)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper()) if isinstance(level, str) else level
        ),
        logger_factory=lambda *args: writer,
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)


def _dumps(obj: Any, **_: Any) -> bytes:
    return orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)
