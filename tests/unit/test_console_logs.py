"""Console log lines (shared/console_format.py, shared/logging.py, conveyor/console.py) and the
scheduler's periodic engine_summary (services/scheduler/summary.py)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from conveyor.console import ConsoleEcho
from services.scheduler.summary import PREFIX_HIT_KEY, PREFIX_QUERY_KEY, EngineSummary, summarize
from shared.console_format import render, summary_text
from shared.logging import configure_logging, resolve_log_format

FINISHED = {
    "ts": "2026-12-01T01:02:03.456789Z",
    "service": "scheduler",
    "level": "info",
    "event": "request_finished",
    "rid": "fe-1-0",
    "finish_reason": "stop",
    "num_output_tokens": 16,
    "error_code": None,
}


def test_console_line_shows_time_service_level_event_and_fields() -> None:
    line = render(FINISHED)
    assert line == (
        "01:02:03.456 scheduler INFO  request_finished rid=fe-1-0 finish_reason=stop "
        "num_output_tokens=16"
    )
    assert "\x1b[" not in line
    coloured = render(FINISHED, colour=True)
    assert "\x1b[" in coloured and "request_finished" in coloured


def test_console_line_keeps_big_fields_out() -> None:
    step = {"event": "step", "service": "scheduler", "rids": ["a"] * 100, "step_id": 7,
            "num_seqs": 3, "step_s": 0.0123456}  # fmt: skip
    line = render(step)
    assert "rids" not in line and "step_id=7" in line and "step_s=0.01235" in line
    other = {"event": "x", "service": "s", "long": "y" * 500, **{f"k{i}": i for i in range(20)}}
    assert len(render(other)) < 300


def test_a_traceback_is_shown_whole_below_its_line() -> None:
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: ' + "z" * 99
    line = render({**FINISHED, "event": "step_failed", "level": "error", "exception": trace})
    head, rest = line.split("\n", 1)
    assert head.endswith("ERROR step_failed rid=fe-1-0 finish_reason=stop num_output_tokens=16")
    assert rest == trace


def test_summary_text_reads_like_prose() -> None:
    text = summary_text({"prompt_tokens_per_s": 123.45, "generation_tokens_per_s": 40.0,
                         "num_running": 3, "num_waiting": 1, "num_preempted": 0,
                         "kv_usage_pct": 12.5, "step_p50_ms": 45.0})  # fmt: skip
    assert text == ("prompt 123.5 tok/s, generation 40.0 tok/s, running 3, waiting 1, "
                    "preempted 0, KV 12.5%, step p50 45.0 ms")  # fmt: skip
    assert "prefix hit 50.0%" in summary_text({"prefix_cache_hit_pct": 50.0})


def _logged(tmp_path: Path, log_format: str) -> tuple[str, list[str]]:
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    log = configure_logging("svc", "info", tmp_path / "svc.log", stream, log_format)
    log.info("request_finished", rid="r1", finish_reason="stop")
    stream.flush()
    shown = stream.buffer.getvalue().decode()  # type: ignore[attr-defined]
    return shown, (tmp_path / "svc.log").read_text().splitlines()


@pytest.mark.parametrize("log_format", ["console", "json", "auto"])
def test_files_get_json_whatever_stdout_gets(tmp_path: Path, log_format: str) -> None:
    shown, file_lines = _logged(tmp_path, log_format)
    record = json.loads(file_lines[0])
    assert record["event"] == "request_finished" and record["service"] == "svc"
    if log_format == "console":
        assert shown.split(" ", 1)[1].startswith("svc       INFO  request_finished rid=r1")
    else:  # auto on a non-terminal is JSON (compose, collectors)
        assert json.loads(shown) == record


def test_auto_is_console_on_a_terminal() -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            assert resolve_log_format("auto", tty) == "console"
        assert resolve_log_format("auto", io.StringIO()) == "json"
        with pytest.raises(ValueError, match="log format"):
            resolve_log_format("yaml", io.StringIO())
    finally:
        os.close(master)
        os.close(slave)


def test_launcher_echo_json_mode_makes_every_line_json() -> None:
    out = io.StringIO()
    echo = ConsoleEcho(out, "json")
    echo.write(" conveyor | started scheduler (pid 1)\n")
    echo.write("scheduler | " + json.dumps(FINISHED) + "\n")
    echo.write("   worker | Traceback (most recent call last): | odd\n")
    echo.say("serving on tcp://x\nand more")
    lines = out.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 4
    assert records[0]["service"] == "conveyor" and records[0]["text"].startswith("started")
    assert records[1] == FINISHED
    assert records[2]["service"] == "worker" and "Traceback" in records[2]["text"]
    assert records[3]["text"] == "serving on tcp://x\nand more"


def test_launcher_echo_console_mode_renders_records() -> None:
    out = io.StringIO()
    echo = ConsoleEcho(out, "console", colour=False)
    echo.write("scheduler | " + json.dumps(FINISHED) + "\n")
    echo.write(" conveyor | ready\n")
    first, second = out.getvalue().splitlines()
    assert first == render(FINISHED)
    assert second.split(" ", 1)[1] == "conveyor  INFO  ready"


class _Recorder:
    """A structlog-shaped logger that keeps what it was given."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def _stats(prefill: float, output: float, running: float = 1, **extra: float) -> dict:
    return {"num_prefill_tokens": prefill, "num_output_tokens": output, "num_running": running,
            "num_waiting": 0, "num_preemptions": 0, "kv_usage": 0.25, **extra}  # fmt: skip


def test_summarize_rates_over_the_interval() -> None:
    out = summarize(_stats(100, 10), _stats(600, 60, num_preemptions=2), 5.0, [0.01, 0.03, 0.02])
    assert out["prompt_tokens_per_s"] == 100.0 and out["generation_tokens_per_s"] == 10.0
    assert out["num_preempted"] == 2 and out["kv_usage_pct"] == 25.0
    assert out["step_p50_ms"] == 20.0 and out["num_steps"] == 3
    assert "prefix_cache_hit_pct" not in out
    before = _stats(0, 0, **{PREFIX_HIT_KEY: 0, PREFIX_QUERY_KEY: 0})
    cached = summarize(before, _stats(0, 0, **{PREFIX_HIT_KEY: 30, PREFIX_QUERY_KEY: 120}), 1.0, [])
    assert cached["prefix_cache_hit_pct"] == 25.0
    assert "draft_acceptance_pct" not in cached
    spec = {"spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 30,
            "spec_decode_num_drafts": 10, "spec_decode_num_accepted_tokens_pos_0": 9,
            "spec_decode_num_accepted_tokens_pos_1": 5}  # fmt: skip
    drafted = summarize(_stats(0, 0, **{k: 0 for k in spec}), _stats(0, 0, **spec), 1.0, [])
    assert drafted["draft_acceptance_pct"] == 75.0 and drafted["num_draft_tokens"] == 40
    assert drafted["num_accepted_tokens"] == 30 and drafted["mean_acceptance_length"] == 4.0
    assert drafted["acceptance_per_position_pct"] == [90.0, 50.0]
    assert "drafts accepted 75.0%" in summary_text(drafted)


def test_summary_every_interval_while_busy_and_silent_when_idle() -> None:
    log = _Recorder()
    summary = EngineSummary(5.0, log)
    assert summary.maybe_emit(100.0, lambda: _stats(0, 0)) is None  # the first baseline
    summary.on_step(0.05)
    assert summary.maybe_emit(104.0, lambda: _stats(50, 5)) is None  # not due yet
    emitted = summary.maybe_emit(105.0, lambda: _stats(50, 5))
    assert emitted is not None and log.lines == [("engine_summary", emitted)]
    assert emitted["generation_tokens_per_s"] == 1.0
    idle = _stats(50, 5, running=0)
    assert summary.maybe_emit(111.0, lambda: idle) is None  # no step, nothing runs: silent
    assert len(log.lines) == 1
    assert summary.maybe_emit(200.0, lambda: None) is None  # no core: starts afresh later
    off = EngineSummary(0.0, log)
    off.on_step(1.0)
    assert off.maybe_emit(1e9, lambda: _stats(1, 1)) is None
    with pytest.raises(ValueError):
        EngineSummary(-1.0, log)
