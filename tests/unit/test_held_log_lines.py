"""Held log events (shared/logging.py): the scheduler's step lines are written in batches, in
file order, and none is lost (the next other record, `flush_held_lines`, the hold time)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import shared.logging as shared_logging
from shared.logging import configure_logging, flush_held_lines


def _lines(stream: io.TextIOWrapper, path: Path) -> tuple[list[str], list[str]]:
    stream.flush()
    shown = stream.buffer.getvalue().decode().splitlines()  # type: ignore[attr-defined]
    return [json.loads(x)["event"] for x in shown], [
        json.loads(x)["event"] for x in path.read_text().splitlines()
    ]


def test_held_lines_keep_their_order_and_are_all_written(tmp_path: Path) -> None:
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    path = tmp_path / "svc.log"
    log = configure_logging("svc", "info", path, stream, "json", held_events=frozenset({"step"}))
    log.info("step", step_id=1)
    log.info("step", step_id=2)
    assert _lines(stream, path) == ([], [])  # held
    log.info("request_finished", rid="r1")  # another record writes the held ones first
    assert _lines(stream, path)[1] == ["step", "step", "request_finished"]
    log.info("step", step_id=3)
    flush_held_lines()  # the scheduler went idle
    shown, in_file = _lines(stream, path)
    assert shown == in_file == ["step", "step", "request_finished", "step"]


def test_a_held_line_waits_at_most_the_hold_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(shared_logging.time, "monotonic", lambda: clock[0])
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    path = tmp_path / "svc.log"
    log = configure_logging("svc", "info", path, stream, "json", held_events=frozenset({"step"}))
    log.info("step", step_id=1)
    clock[0] += shared_logging.HOLD_S / 2
    log.info("step", step_id=2)
    assert _lines(stream, path)[1] == []
    clock[0] += shared_logging.HOLD_S / 2
    log.info("step", step_id=3)  # the first one is HOLD_S old: all three go out
    assert _lines(stream, path)[1] == ["step"] * 3


def test_no_held_events_writes_each_record_at_once(tmp_path: Path) -> None:
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    path = tmp_path / "svc.log"
    log = configure_logging("svc", "info", path, stream, "json")
    log.info("step", step_id=1)
    assert _lines(stream, path)[1] == ["step"]
