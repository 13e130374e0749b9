"""What `conveyor up` prints: its services' log lines as console lines or as JSON lines.

The services under the launcher always write JSON (their stdout is a pipe, and the launcher sets
CONVEYOR_LOG_FORMAT=json); the launcher copies each line into `<log-dir>/<service>.log` unchanged
and hands it, prefixed `"<service> | "`, to its echo stream (conveyor/procs.py). `ConsoleEcho` is
that stream: it renders each line for a person (`console`) or passes it on as one JSON object per
line (`json`: lines that are not JSON, such as the launcher's own notes or a traceback, are
wrapped in a record), so with `--log-format json` every stdout line parses as JSON.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any, Optional, TextIO

import orjson

from shared.console_format import render, render_text

LAUNCHER = "conveyor"  # the `service` of the launcher's own lines


class ConsoleEcho:
    """A write-only text stream for the launcher's echo. Each `write` gets whole lines
    `"<service> | <text>\\n"`; thread-safe (every service's tee thread writes here)."""

    def __init__(self, out: TextIO, log_format: str, colour: Optional[bool] = None) -> None:
        if log_format not in ("console", "json"):
            raise ValueError("log_format must be 'console' or 'json' (resolve 'auto' first)")
        self._out = out
        self._json = log_format == "json"
        self._colour = (not self._json) and (_isatty(out) if colour is None else colour)
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        shown = [self.render_line(line) for line in text.splitlines() if line.strip()]
        if shown:
            with self._lock:
                self._out.write("".join(s + "\n" for s in shown))
                self._out.flush()
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def say(self, text: str) -> None:
        """A message of the launcher's own (may span lines: one record, one console block)."""
        if self._json:
            shown = _dumps(_record(LAUNCHER, text))
        else:
            shown = render_text(LAUNCHER, text, self._colour)
        with self._lock:
            self._out.write(shown + "\n")
            self._out.flush()

    def render_line(self, line: str) -> str:
        """One `"<service> | <text>"` line as shown on our stdout."""
        service, sep, body = line.partition(" | ")
        if not sep:
            service, body = LAUNCHER, line
        service = service.strip()
        record = _parse(body)
        if self._json:
            return body if record is not None else _dumps(_record(service, body))
        if record is None:
            return render_text(service, body, self._colour)
        record.setdefault("service", service)
        return render(record, self._colour)


def _parse(body: str) -> Optional[dict[str, Any]]:
    if not body.startswith("{"):
        return None
    try:
        record = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _record(service: str, text: str) -> dict[str, Any]:
    """A non-JSON line as a log record, so JSON consumers see one shape."""
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
    return {"ts": now, "service": service, "level": "info", "event": "output", "text": text}


def _dumps(record: dict[str, Any]) -> str:
    return orjson.dumps(record).decode()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
