"""Per-function CPU profiles of running services with py-spy (a bench tool, not a dependency).

`bench/sim_overhead.py --py-spy DIR` samples the scheduler, the simulated worker and the
tokenizer during the steady state of each run (`py-spy record --nonblocking --function --format
raw`: the processes are never paused; idle samples are left out, so a sample is CPU time) and
prints, per process, the functions with the most CPU time per step: self (the function's own
lines) and total (with what it calls). Install it into the venv only for this:
`.venv/bin/pip install py-spy`; it needs ptrace rights on the services.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

PROFILED = ("scheduler", "worker", "tokenizer")  # LocalStack service names
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy_binary() -> str:
    found = shutil.which("py-spy") or str(Path(__import__("sys").executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


class Sampler:
    """Records each of `pids` (name -> pid) for `duration_s`, starting `delay_s` from `start()`,
    into `out_dir/<name>.txt`; `window` is the (start, end) wall time actually sampled."""

    def __init__(self, pids: dict[str, int], out_dir: Path, delay_s: float, duration_s: float,
                 rate_hz: int = 200) -> None:  # fmt: skip
        self.pids = {n: p for n, p in pids.items() if n in PROFILED}
        self.out_dir = out_dir
        self.delay_s = delay_s
        self.duration_s = duration_s
        self.rate_hz = rate_hz
        self.window: Optional[tuple[float, float]] = None
        self.cpu_s: dict[str, float] = {}  # name -> CPU seconds (user + system) in the window
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        time.sleep(self.delay_s)
        exe = py_spy_binary()
        procs = [
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(int(self.duration_s)),
                    "--rate",
                    str(self.rate_hz),
                    "--nonblocking",
                    "--function",
                    "--format",
                    "raw",
                    "-o",
                    str(self.out_dir / f"{name}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for name, pid in self.pids.items()
        ]
        begin = time.time()
        cpu0 = {name: _cpu_seconds(pid) for name, pid in self.pids.items()}
        for proc in procs:
            proc.wait()
        self.cpu_s = {name: _cpu_seconds(pid) - cpu0[name] for name, pid in self.pids.items()}
        self.window = (begin, begin + self.duration_s)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far, from /proc (Linux): exact, unlike
    samples, and free of the sampler's own cost."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _func(frame: str) -> str:
    m = _FRAME.match(frame)
    if m is None:
        return frame
    return f"{m['func']} ({Path(m['file']).name})"


def top_functions(raw: Path, num_steps: int, rate_hz: int, limit: int = 15) -> list[str]:
    """Lines `self us/step  total us/step  function (file)`, by self time, from a raw
    (collapsed stacks) py-spy file."""
    self_n: Counter[str] = Counter()
    total_n: Counter[str] = Counter()
    num_samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        num_samples += n
        frames = [_func(f) for f in stack.split(";")]
        self_n[frames[-1]] += n
        for f in set(frames):
            total_n[f] += n
    us = 1e6 / rate_hz / max(1, num_steps)  # one sample, in microseconds per step
    out = [f"  busy {num_samples * us:9.1f} us/step ({num_samples} samples)"]
    out += [f"  {n * us:9.1f} self {total_n[f] * us:9.1f} total  {f}"
            for f, n in self_n.most_common(limit)]  # fmt: skip
    return out
