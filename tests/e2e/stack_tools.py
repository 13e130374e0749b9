"""Helpers for the e2e tests: settings for a real stack on free ports, and process checks
through /proc (Linux)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from conveyor.launcher import StackSettings, gateway_available

# Small enough to allocate fast, large enough for 64 concurrent short requests (each block
# holds 16 tokens; 384 MiB in fp32 is ~540 blocks, ~8.6k tokens).
ENGINE_WORKER_FLAGS = {"dtype": "float32", "kv_cache_memory": "384MiB", "max_model_len": "2048"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (tests run in parallel: never a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_settings(log_dir: Path, gateway: bool = True, **overrides: Any) -> StackSettings:
    """Settings for a real-model stack on free ports (also used by tests that need their own)."""
    fields: dict[str, Any] = dict(
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        worker_flags=dict(ENGINE_WORKER_FLAGS),
        gateway=gateway and gateway_available(),
        http_port=free_port(),
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
