"""`conveyor logs --rid ID`: one request's journey across the services' JSON log files.

ID may be the client's request id (as the client chose it) or the internal rid the frontend
made of it: lines that name the client id link it to its rid(s), then every line with such a
rid, from every `<log-dir>/*.log`, is shown in time order. `--steps` adds the scheduler steps
that carried the request.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.bench.steplog import with_step_columns
from conveyor.stack_settings import DEFAULT_LOG_DIR
from shared.env import env_path

ID_KEYS = ("rid", "id", "request_id", "client_id")
SHOWN_FIRST = ("ts", "service", "event", "rid")


def add_logs_command(sub: Any) -> None:
    p = sub.add_parser("logs", help="show one request's journey across the services")
    p.add_argument("--rid", required=True, help="the request id (client id or internal rid)")
    p.add_argument("--log-dir", type=Path, default=env_path("LOG_DIR") or DEFAULT_LOG_DIR,
                   help="`conveyor up`'s --log-dir (CONVEYOR_LOG_DIR)")  # fmt: skip
    p.add_argument("--steps", action="store_true", help="also the step lines that carried it")
    p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    p.set_defaults(func=cmd_logs)


def read_lines(log_dir: Path) -> Iterator[dict[str, Any]]:
    """Every JSON object line of every *.log in `log_dir` (other lines are skipped), step
    lines with their per-request lists restored (conveyor/bench/steplog.py)."""
    for path in sorted(log_dir.glob("*.log")):
        yield from with_step_columns(_read_file(path))


def _read_file(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                record.setdefault("service", path.stem)
                yield record


def journey(records: list[dict[str, Any]], request_id: str, steps: bool) -> list[dict[str, Any]]:
    """The records about `request_id`, in time order."""
    rids = {request_id}
    for r in records:  # a line naming the client id links it to the internal rid
        if any(r.get(k) == request_id for k in ID_KEYS) and isinstance(r.get("rid"), str):
            rids.add(r["rid"])
    out = []
    for r in records:
        if any(r.get(k) in rids for k in ID_KEYS):
            out.append(r)
        elif steps and r.get("event") == "step" and _mentions(r, rids):
            out.append(r)
    return sorted(out, key=lambda r: str(r.get("ts", "")))


def _mentions(record: dict[str, Any], rids: set[str]) -> bool:
    return any(isinstance(v, list) and not rids.isdisjoint(map(str, v)) for v in record.values())


def format_record(r: dict[str, Any]) -> str:
    head = " ".join(str(r.get(k, "-")) for k in SHOWN_FIRST)
    rest = " ".join(f"{k}={json.dumps(v)}" for k, v in r.items() if k not in SHOWN_FIRST)
    return f"{head} {rest}".rstrip()


def cmd_logs(args: argparse.Namespace) -> int:
    if not args.log_dir.is_dir():
        print(f"conveyor: no log directory {args.log_dir}", file=sys.stderr)
        return 1
    found = journey(list(read_lines(args.log_dir)), args.rid, args.steps)
    if not found:
        print(f"conveyor: no log line mentions {args.rid!r} in {args.log_dir}", file=sys.stderr)
        return 1
    for r in found:
        print(json.dumps(r) if args.json else format_record(r))
    return 0
