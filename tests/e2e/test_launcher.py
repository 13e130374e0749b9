"""The user face: `conveyor up` (issue test 5, second half), `generate`, `stats`, `logs`.

`up` runs as a real child process with the SIMULATED worker (fast start; the supervision is
what is tested): SIGTERM stops it with exit 0 and no process behind; with `--restart no` a
killed worker makes it report and exit non-zero, again with no process behind (restarts:
test_engine_faults.py). `generate`, `stats` and `logs` run
against the session's shared engine. Rough runtime: 30-60 s on the shared machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shared.client import Client
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import UpProcess, descendants, free_port, start_up, wait_gone

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("services.scheduler", "services.worker.sim", "services.tokenizer")


def _conveyor(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)  # fmt: skip


def _start_up(tmp_path: Path, *flags: str) -> tuple[UpProcess, dict[int, str]]:
    up, _address = start_up(tmp_path, *flags)
    children = descendants(up.proc.pid)
    for module in SERVICES:
        assert any(module in cmd for cmd in children.values()), (module, children)
    return up, children


def test_up_then_sigterm_leaves_no_process(tmp_path: Path) -> None:
    up, children = _start_up(tmp_path)
    up.proc.send_signal(signal.SIGTERM)
    rc, out, _err = up.finish(timeout=60)
    assert rc == 0
    assert wait_gone(list(children), timeout=5 + SLOW_HOST_MARGIN_S) == []
    # every service's output reached our stdout (JSON lines: stdout is a pipe) and its own log
    shown = {json.loads(line)["service"] for line in out.splitlines() if line.strip()}
    assert {"conveyor", "scheduler", "simworker", "tokenizer"} <= shown, shown
    for name in ("scheduler", "worker", "tokenizer"):
        assert (tmp_path / "logs" / f"{name}.log").stat().st_size > 0


def test_up_with_restart_no_reports_a_dead_worker_and_exits_nonzero(tmp_path: Path) -> None:
    """`--restart no` keeps the old behaviour: a dead worker stops the engine (the default,
    on-failure, restarts it: tests/e2e/test_engine_faults.py)."""
    up, children = _start_up(tmp_path, "--restart", "no")
    worker = next(pid for pid, cmd in children.items() if "services.worker.sim" in cmd)
    os.kill(worker, signal.SIGKILL)
    rc, _out, err = up.finish(timeout=60)
    assert rc == 1
    assert "worker died" in err
    assert wait_gone(list(children), timeout=5 + SLOW_HOST_MARGIN_S) == []


def test_generate_streams_the_text(engine: Any) -> None:
    done = _conveyor("generate", "The capital of France is", "--max-tokens", "6",
                     "--temperature", "0", "--address", engine.frontend_address)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with Client(engine.frontend_address, timeout=300) as client:
        want = client.generate("The capital of France is", max_tokens=6, temperature=0.0)
    assert done.stdout == want.text + "\n"


def test_generate_errors_go_to_stderr_with_nonzero_exit(engine: Any) -> None:
    bad = _conveyor("generate", "Hi", "--temperature", "-1", "--address", engine.frontend_address)
    assert bad.returncode == 1 and "invalid_params" in bad.stderr and bad.stdout == ""
    nobody = f"tcp://127.0.0.1:{free_port()}"
    gone = _conveyor("generate", "Hi", "--address", nobody, "--timeout", "2")
    assert gone.returncode == 1 and "engine_unreachable" in gone.stderr


def test_stats_prints_engine_counters(engine: Any) -> None:
    done = _conveyor("stats", "--address", engine.frontend_address)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["ready"] is True and stats["engine"]["kv_blocks_total"] > 0


def test_logs_show_one_requests_journey(engine: Any) -> None:
    with Client(engine.frontend_address, timeout=300) as client:
        client.generate("Hello there", max_tokens=3, request_id="journey-1")
    deadline = time.monotonic() + 10
    while True:  # the launcher's log writer may lag by a moment
        done = _conveyor("logs", "--rid", "journey-1", "--log-dir", str(engine.log_dir),
                         "--json")  # fmt: skip
        records = [json.loads(line) for line in done.stdout.splitlines()]
        services = {r["service"] for r in records}
        if {"tokenizer", "scheduler", "worker"} <= services or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"tokenizer", "scheduler", "worker"} <= services, records
    assert len({r["rid"] for r in records}) == 1  # the client id resolved to one rid
    assert records == sorted(records, key=lambda r: r["ts"])


def test_chat_answers_each_line_with_the_chat_template(engine: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "chat", "--address", engine.frontend_address,
         "--max-tokens", "5", "--temperature", "0"],
        cwd=ROOT, input="Hello!\nAnd again?\n\n", text=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with Client(engine.frontend_address, timeout=300) as client:
        first = client.generate(messages=[{"role": "user", "content": "Hello!"}],
                                max_tokens=5, temperature=0.0)  # fmt: skip
    assert done.stdout.startswith("you> " + first.text)
    assert done.stdout.count("you> ") == 3  # two questions, then the empty line ends it


def test_model_prepare_and_passthroughs() -> None:
    done = _conveyor("model", "prepare")
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "config.json").is_file()
    for command in ("bench", "sim"):
        helped = _conveyor(command, "--help")
        assert helped.returncode == 0 and "usage" in helped.stdout.lower(), helped.stderr
