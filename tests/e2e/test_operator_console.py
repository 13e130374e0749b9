"""What an operator sees in a terminal: `conveyor up`'s console lines and engine summary,
`conveyor top`, and `--log-format json` (every stdout line JSON; log files JSON either way).

Each command runs as a real child process in a real pseudo-terminal (pexpect), so `auto` picks
the console exactly as it would for a person, and `top` gets a keyboard. The engines use the
SIMULATED worker (cpu-smollm2 profile: CPU-sized step times without loading the model), which
keeps each test to seconds; what is checked is the operator side, which is the same for both
workers. Rough runtime: 30-40 s for the module.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from conveyor.launcher import LocalStack
from services.worker.sim.config import SimConfig
from shared.client import Client
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import engine_settings, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][AB0-2]|\x1b[=>78]")
READY_S = 120.0  # a busy 2-core machine: the tokenizer's load takes seconds, not minutes
SUMMARY_WITHIN_S = 10.0 + SLOW_HOST_MARGIN_S  # promised 10 s; the default interval is 5 s
CONSOLE_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (\w+)\s+(INFO|WARNING|ERROR|DEBUG)\s+(\S+)")


def _spawn(args: list[str], log_path: Path) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "conveyor", *args], cwd=str(ROOT),
                          encoding="utf-8", codec_errors="replace", dimensions=(50, 160),
                          timeout=READY_S)  # fmt: skip
    child.logfile_read = log_path.open("w")  # what the terminal showed, for a failure's story
    return child


def _up_args(tmp_path: Path, address: str, *extra: str) -> list[str]:
    return ["up", "--worker", "sim", "--sim-device", "cpu-smollm2", "--sim-model",
            "smollm2-135m", "--no-gateway", "--frontend-addr", address,
            "--log-dir", str(tmp_path / "logs"), *extra]  # fmt: skip


def _stop(child: pexpect.spawn) -> None:
    if child.isalive():
        child.kill(signal.SIGINT)  # Ctrl-C: the launcher drains and stops every service
        child.expect(pexpect.EOF, timeout=60)
    child.close()


def _ask(address: str, max_tokens: int = 32) -> None:
    with Client(address, timeout=60) as client:
        done = client.generate("Hello there", max_tokens=max_tokens, ignore_eos=True)
    assert done.usage["completion_tokens"] == max_tokens


def _json_log_files(log_dir: Path) -> dict[str, list[dict]]:
    files = {p.stem: p.read_text().splitlines() for p in sorted(log_dir.glob("*.log"))}
    assert {"scheduler", "worker", "tokenizer"} <= set(files), files  # the launcher's names
    return {name: [json.loads(line) for line in lines if line] for name, lines in files.items()}


def test_up_shows_console_lines_and_a_summary_soon_after_a_request(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    child = _spawn(_up_args(tmp_path, address), tmp_path / "terminal.txt")
    try:
        child.expect("serving on")
        asked = time.monotonic()
        _ask(address, max_tokens=16)
        child.expect(r"engine_summary[^\r\n]*KV [0-9.]+%", timeout=SUMMARY_WITHIN_S)
        assert time.monotonic() - asked <= SUMMARY_WITHIN_S
        summary = ANSI.sub("", child.after)
        assert re.search(r"generation [0-9.]+ tok/s, running \d+, waiting \d+", summary), summary
    finally:
        _stop(child)
    shown = [ANSI.sub("", line) for line in (tmp_path / "terminal.txt").read_text().splitlines()]
    events = {m.group(3) for line in shown if (m := CONSOLE_LINE.match(line.strip()))}
    assert {"request_admitted", "request_finished", "engine_summary"} <= events, shown
    assert not any(line.lstrip().startswith("{") for line in shown), "JSON on a console"
    records = _json_log_files(tmp_path / "logs")
    assert any(r["event"] == "engine_summary" for r in records["scheduler"])
    assert any(r["event"] == "request_finished" for r in records["tokenizer"])


def test_up_log_format_json_prints_only_json(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    args = _up_args(tmp_path, address, "--log-format", "json", "--summary-interval", "1")
    child = _spawn(args, tmp_path / "terminal.txt")
    try:
        child.expect("serving on")  # inside a JSON record now
        _ask(address)
        child.expect("engine_summary", timeout=SUMMARY_WITHIN_S)
    finally:
        _stop(child)
    lines = [ln for ln in (tmp_path / "terminal.txt").read_text().splitlines() if ln.strip()]
    records = [json.loads(line) for line in lines]  # raises on the first line that is not JSON
    services = {r.get("service") for r in records}
    assert {"conveyor", "scheduler", "tokenizer", "simworker"} <= services, services
    assert any(r.get("event") == "engine_summary" for r in records)
    assert _json_log_files(tmp_path / "logs")["scheduler"]


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = engine_settings(
        tmp_path_factory.mktemp("top-logs"), gateway=False, worker="sim",
        sim_config=SimConfig(device="cpu-smollm2", model="smollm2-135m"),
    )  # fmt: skip
    with LocalStack(settings) as stack:
        yield stack.frontend_address


def _burst(address: str, num_requests: int, max_tokens: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=_ask, args=(address, max_tokens), daemon=True)
               for _ in range(num_requests)]  # fmt: skip
    for t in threads:
        t.start()
    return threads


def _running_counts(child: pexpect.spawn, seconds: float) -> list[int]:
    """The `running` row of every frame top drew in the next `seconds`."""
    text = ""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            text += child.read_nonblocking(size=1 << 16, timeout=0.2)
        except pexpect.TIMEOUT:
            continue
    return [int(n) for n in re.findall(r"running\s+(\d+)", ANSI.sub("", text))]


def test_top_shows_running_requests_during_a_burst_and_quits_on_q(
    sim_engine: str, tmp_path: Path
) -> None:
    child = _spawn(["top", "--address", sim_engine, "--interval", "0.5"], tmp_path / "top.txt")
    try:
        child.expect("conveyor top")
        threads = _burst(sim_engine, num_requests=8, max_tokens=32)
        shown: list[int] = []
        deadline = time.monotonic() + 30.0
        while not any(shown) and time.monotonic() < deadline:
            shown += _running_counts(child, seconds=1.0)
        assert any(shown), f"top never showed a running request during the burst: {shown}"
        child.send("q")
        child.expect(pexpect.EOF, timeout=10)
    finally:
        child.close()
    assert child.exitstatus == 0, child.exitstatus
    for t in threads:
        t.join(60)
    screens = ANSI.sub("", (tmp_path / "top.txt").read_text())
    assert "TTFT ms p50/90/99" in screens and sim_engine in screens
