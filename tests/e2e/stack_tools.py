"""Helpers for the e2e tests: settings for a real stack on free ports, a started stack for a
fixture, and process checks through /proc (Linux)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from conveyor.launcher import LocalStack, StackSettings, gateway_available, probe_health
from services.gateway.config import GatewayConfig
from services.worker.config import WorkerConfig
from shared.config_flags import config_argv
from tests.bounds import SLOW_HOST_MARGIN_S

ROOT = Path(__file__).resolve().parents[2]

# Small enough to allocate fast, large enough for 64 concurrent short requests (each block
# holds 16 tokens; 384 MiB in fp32 is ~540 blocks, ~8.6k tokens). The exact-greedy tests compare
# tokens with fp32 transformers on the dequantized weights: fp32 and `--quantization none`
# pinned (the quantized default has its own agreement tests: test_quant_quality.py).
ENGINE_WORKER = WorkerConfig(
    dtype="float32", quantization="none", kv_cache_memory=384 << 20, max_model_len=2048
)


READY_TIMEOUT_S = 180.0  # a cold start loads torch (and the model) in every process


def running_stack(settings: StackSettings) -> Iterator[LocalStack]:
    """Start the stack, wait until it answers, yield it, stop it (also when a test failed).
    Use as `yield from running_stack(settings)` in a fixture."""
    stack = LocalStack(settings).start()
    try:
        stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield stack
    finally:
        stack.stop()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (tests run in parallel: never a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_settings(log_dir: Path, gateway: bool = True, **overrides: Any) -> StackSettings:
    """Settings for a real-model stack on free ports (also used by tests that need their own)."""
    fields: dict[str, Any] = dict(
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        worker_config=ENGINE_WORKER,
        gateway=gateway and gateway_available(),
        gateway_config=GatewayConfig(http_port=free_port()),
        log_dir=log_dir,
        drain_timeout_s=5.0,
    )
    fields.update(overrides)
    return StackSettings(**fields)


def _ppid_and_state(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    rest = stat[stat.rindex(")") + 2 :].split()  # fields after "(comm)": state, ppid, ...
    return int(rest[1]), rest[0]


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) descendant of `root`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid, state = _ppid_and_state(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if state != "Z":
            children.setdefault(ppid, []).append(int(entry))
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out[pid] = cmdline(pid)
            todo.append(pid)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return _ppid_and_state(pid)[1] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class UpProcess:
    """`conveyor up` as a child; a thread collects its stdout so it never blocks."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)  # fmt: skip
        self.lines: list[str] = []
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_serving(self, timeout: float) -> None:
        """Until `up` says it serves (it has seen the engine ready itself)."""
        deadline = time.monotonic() + timeout
        while not any("serving on" in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "conveyor up never became ready"
            time.sleep(0.2)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        _, err = self.proc.communicate(timeout=timeout)
        self._pump.join(5)
        return self.proc.returncode, "".join(self.lines), err


def start_up(
    tmp_path: Path, *flags: str, worker: str = "sim", http_port: Optional[int] = None
) -> tuple[UpProcess, str]:
    """`conveyor up` with the SIMULATED worker (or, `worker="model"`, the real one in fp32 with
    ENGINE_WORKER) and no gateway (with `http_port`: the gateway on that port), serving:
    (process, address). `flags` come last: they may override ENGINE_WORKER's."""
    address = f"tcp://127.0.0.1:{free_port()}"
    worker_flags = ["--worker", worker]
    if worker == "model":
        worker_flags += config_argv(ENGINE_WORKER, {})
    gateway = ["--no-gateway"] if http_port is None else ["--http-port", str(http_port)]
    argv = [sys.executable, "-m", "conveyor", "up", *worker_flags, *gateway,
            "--frontend-addr", address, "--log-dir", str(tmp_path / "logs"), *flags]  # fmt: skip
    up = UpProcess(argv)
    up.wait_serving(timeout=600)
    assert probe_health(address, timeout=5.0 + SLOW_HOST_MARGIN_S)
    return up, address
