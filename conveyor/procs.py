"""Child processes of the local launcher: start, tee output, stop without orphans.

Each service runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which
then stops the services in order) and with PR_SET_PDEATHSIG (so the services get SIGTERM even
if the launcher itself is killed). One thread per child copies its merged stdout/stderr to
`<log_dir>/<name>.log` and, when echoing, to our stdout prefixed with the service's name.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

_PR_SET_PDEATHSIG = 1
_PRINT_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM us when the launcher dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own stop() still cleans up
        pass


class ServiceProcess:
    """One service child process and the thread that tees its output."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_dir: Path,
        echo: Optional[TextIO],
        cwd: Optional[Path] = None,
        hide: tuple[str, ...] = (),
    ) -> None:
        """`hide`: substrings of lines kept out of the echo (they still go to the log file)."""
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._echo = echo
        self._hide = hide
        self._thread = threading.Thread(target=self._pump, name=f"tee-{name}", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101 - set by Popen(stdout=PIPE)
        prefix = f"{self.name:>9} | "
        for line in self.proc.stdout:
            self.tail.append(line)
            self._log.write(line)
            self._log.flush()
            if self._echo is not None and not any(h in line for h in self._hide):
                with _PRINT_LOCK:
                    self._echo.write(prefix + line)
                    self._echo.flush()
        self._log.close()

    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)  # its own session: reach its children too
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def join_output(self, timeout: float = 2.0) -> None:
        self._thread.join(timeout)

    def last_lines(self, n: int = 15) -> str:
        return "".join(list(self.tail)[-n:])


def stop_in_order(groups: list[list[ServiceProcess]], timeout_s: float) -> None:
    """SIGTERM each group in turn, waiting up to `timeout_s` per group; SIGKILL what is left."""
    for group in groups:
        for svc in group:
            svc.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for svc in group:
            if svc.wait(deadline - time.monotonic()) is None:
                svc.kill()
    for group in groups:
        for svc in group:
            if svc.returncode() is None:
                svc.kill()
            svc.join_output()
