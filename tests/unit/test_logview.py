"""conveyor/logview.py: one request's journey from the services' JSON log files."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.logview import journey, read_lines

LINES = {
    "tokenizer": [
        {"ts": "2026-01-01T00:00:01Z", "event": "request_received", "rid": "fe-1-7",
         "client_id": "my-id"},
        {"ts": "2026-01-01T00:00:09Z", "event": "request_finished", "rid": "fe-1-7"},
        {"ts": "2026-01-01T00:00:02Z", "event": "request_received", "rid": "fe-1-8",
         "client_id": "other"},
    ],
    "scheduler": [
        {"ts": "2026-01-01T00:00:03Z", "event": "request_admitted", "rid": "fe-1-7"},
        {"ts": "2026-01-01T00:00:04Z", "event": "step", "rids": ["fe-1-7", "fe-1-8"]},
        {"ts": "2026-01-01T00:00:05Z", "event": "step", "rids": ["fe-1-8"]},
    ],
    "worker": [{"ts": "2026-01-01T00:00:04Z", "event": "sequence_started", "rid": "fe-1-7"}],
}  # fmt: skip


def _write(tmp_path: Path) -> None:
    for service, records in LINES.items():
        text = "\n".join(json.dumps({"service": service, **r}) for r in records)
        (tmp_path / f"{service}.log").write_text("Traceback: not json\n" + text + "\n")


def test_client_id_resolves_to_its_rid_across_services(tmp_path: Path) -> None:
    _write(tmp_path)
    found = journey(list(read_lines(tmp_path)), "my-id", steps=False)
    assert [(r["service"], r["event"]) for r in found] == [
        ("tokenizer", "request_received"),
        ("scheduler", "request_admitted"),
        ("worker", "sequence_started"),
        ("tokenizer", "request_finished"),
    ]


def test_steps_are_added_on_request(tmp_path: Path) -> None:
    _write(tmp_path)
    found = journey(list(read_lines(tmp_path)), "fe-1-7", steps=True)
    steps = [r for r in found if r["event"] == "step"]
    assert [r["rids"] for r in steps] == [["fe-1-7", "fe-1-8"]]
