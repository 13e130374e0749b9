"""`make test`: each test group in its own pytest process, then one closing line.

Kernel tests run under the Triton interpreter in their own process: an out-of-bounds load there
segfaults, which must show up as a failed group, not take the other groups down.

Time budgets, so that a hung test fails by name instead of hanging `make test`:
* per test (pytest-timeout, the test's own body; fixtures have their own time-outs): a test
  that runs past its group's `test_s` fails with its stack, and the group goes on;
* per group (`group_s`, wall clock): a group that outruns it (a hang pytest-timeout cannot
  interrupt: inside a fixture, or in C code that never returns to Python) is stopped, and the
  test it was running is named (tests/support/progress.py).
Each budget is several times what the group takes alone on the 2-core machine, so a busy host
does not trip it; the slowest tests of each group are listed (`--durations`).

A skipped test fails the run: `make test` installs whatever a test needs, so a skip can only
mean a test that did not check what it claims.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.progress import ENV as PROGRESS_ENV
from tests.support.progress import in_progress

ROOT = Path(__file__).resolve().parent.parent

NUM_SLOWEST = 15  # per group, in the output (`--durations`)
STOP_GRACE_S = 20.0  # after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Group:
    name: str
    paths: list[str]
    test_s: int  # pytest-timeout per test
    group_s: int  # the whole group, wall clock
    env: dict[str, str] = field(default_factory=dict)


GROUPS: list[Group] = [
    Group("unit", ["tests/unit"], test_s=180, group_s=1200),
    Group("kernels", ["tests/kernels"], test_s=300, group_s=900, env={"TRITON_INTERPRET": "1"}),
    Group("e2e", ["tests/e2e"], test_s=300, group_s=1800),
]


def counts_from_xml(xml: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            tests = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts["passed"] += tests - failed - skipped
            counts["failed"] += failed
            counts["skipped"] += skipped
    return counts


def run_group(group: Group, tmp: Path) -> tuple[int, dict[str, int]]:
    xml, progress = tmp / f"{group.name}.xml", tmp / f"{group.name}.progress"
    env = {**os.environ, **group.env, PROGRESS_ENV: str(progress)}
    existing = [p for p in group.paths if (ROOT / p).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", "-p",
           "tests.support.progress", f"--timeout={group.test_s}", "-o", "timeout_func_only=true",
           f"--durations={NUM_SLOWEST}", *existing]  # fmt: skip
    print(f"\n=== {group.name}: {' '.join(cmd[2:])} (budget {group.group_s}s)", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=group.group_s)
        hung = ""
    except subprocess.TimeoutExpired:
        hung = in_progress(progress) or "(between tests)"
        rc = _stop(proc)
    counts = counts_from_xml(xml)
    if hung:
        print(f"=== {group.name}: over its {group.group_s}s budget, stopped while running "
              f"{hung}", flush=True)  # fmt: skip
        counts["failed"] += 1
    elif rc not in (0, 1) and counts["failed"] == 0:
        counts["failed"] += 1  # crashed (e.g. a segfault) or collected nothing (exit 5)
    print(f"=== {group.name}: rc={rc} {counts} in {time.monotonic() - start:.0f}s", flush=True)
    return rc, counts


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM the group's whole process group (pytest and what it started), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=STOP_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def main(argv: list[str]) -> int:
    selected = argv or [g.name for g in GROUPS]
    total = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        for group in GROUPS:
            if group.name not in selected:
                continue
            rc, counts = run_group(group, Path(tmp))
            worst = worst or (rc != 0)
            for k in total:
                total[k] += counts[k]
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    if total["skipped"]:
        print("a test skipped: `make test` must install whatever a test needs (see -ra above)")
    return 1 if worst or total["failed"] or total["skipped"] or total["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
