"""`make test`: each test group in its own pytest process, then one closing line.

Kernel tests run under the Triton interpreter in their own process: an out-of-bounds load there
segfaults, which must show up as a failed group, not take the other groups down. The e2e tests
are two groups (tests/e2e/conftest.py): those that use the session's real-model engine (one
process holds it) and those that start stacks of their own.

Two groups run at a time: two lanes take the next group from GROUPS, in order, as they free up
(the real-model engine's group first: it is the longest and grows the most). Most e2e tests
spend their time waiting on the processes they start (one group after the other kept ~1.2 of
2 cores busy), so the other lane fills the idle core; every test must hold on a busy machine
anyway (tests/bounds.py). Each group's output is printed as one block when the group ends.
`--serial` runs the groups one after the other, printing as they go.

Two lanes share the CPUs: each group's processes get the lane's share of torch threads
(OMP_NUM_THREADS, unless the caller set it). With torch's default (all cores) in every worker,
test process and reference model of both lanes, OpenMP threads spin-wait for each other on
oversubscribed cores: two e2e files side by side on 2 cores took 129-133 s with the default and
70 s with one thread each (test_structured_faults in it: 99 -> 32 s), 2026-12-02.

Time budgets, so that a hung test fails by name instead of hanging `make test`:
* per test (pytest-timeout, the test's own body; fixtures have their own time-outs): a test
  that runs past its group's `test_s` fails with its stack, and the group goes on;
* per group (`group_s`, wall clock): a group that outruns it (a hang pytest-timeout cannot
  interrupt: inside a fixture, or in C code that never returns to Python) is stopped, and the
  test it was running is named (tests/support/progress.py).
Each budget is several times what the group takes on the 2-core machine beside another group;
the slowest tests of each group are listed (`--durations`).

A skipped test fails the run: `make test` installs whatever a test needs, so a skip can only
mean a test that did not check what it claims.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

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


GROUPS: list[Group] = [  # the order the lanes take them in
    Group("e2e-engine", ["tests/e2e"], test_s=300, group_s=1800,
          env={"CONVEYOR_E2E_PART": "engine"}),
    Group("e2e-stacks", ["tests/e2e"], test_s=300, group_s=1200,
          env={"CONVEYOR_E2E_PART": "stacks"}),
    Group("unit", ["tests/unit"], test_s=180, group_s=1200),
    Group("kernels", ["tests/kernels"], test_s=300, group_s=900, env={"TRITON_INTERPRET": "1"}),
]  # fmt: skip
NUM_LANES = 2


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


def lane_threads(num_lanes: int) -> dict[str, str]:
    """The torch thread settings of one lane's share of the CPUs; none where the caller chose."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    share = str(max(1, len(os.sched_getaffinity(0)) // num_lanes))
    return {"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}


def run_group(
    group: Group, tmp: Path, out: Optional[IO[str]] = None, num_lanes: int = 1
) -> tuple[int, dict[str, int]]:
    """Run one group; its pytest output goes to `out` (None: this process's stdout), then its
    closing line. Returns (pytest's exit code, counts)."""
    xml, progress = tmp / f"{group.name}.xml", tmp / f"{group.name}.progress"
    env = {**os.environ, **lane_threads(num_lanes), **group.env, PROGRESS_ENV: str(progress)}
    existing = [p for p in group.paths if (ROOT / p).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", "-p",
           "tests.support.progress", f"--timeout={group.test_s}", "-o", "timeout_func_only=true",
           f"--durations={NUM_SLOWEST}", *existing]  # fmt: skip
    write = out.write if out is not None else sys.stdout.write
    write(f"\n=== {group.name}: {' '.join(cmd[2:])} (budget {group.group_s}s)\n")
    (out or sys.stdout).flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=out,
                            stderr=subprocess.STDOUT if out is not None else None)  # fmt: skip
    try:
        rc = proc.wait(timeout=group.group_s)
        hung = ""
    except subprocess.TimeoutExpired:
        hung = in_progress(progress) or "(between tests)"
        rc = _stop(proc)
    counts = counts_from_xml(xml)
    if hung:
        write(f"=== {group.name}: over its {group.group_s}s budget, stopped while running {hung}\n")
        counts["failed"] += 1
    elif rc not in (0, 1) and counts["failed"] == 0:
        counts["failed"] += 1  # crashed (e.g. a segfault) or collected nothing (exit 5)
    write(f"=== {group.name}: rc={rc} {counts} in {time.monotonic() - start:.0f}s\n")
    (out or sys.stdout).flush()
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


def run_lanes(groups: list[Group], tmp: Path) -> list[tuple[int, dict[str, int]]]:
    """The groups, NUM_LANES at a time: each lane takes the next group in order as it frees
    up; each group's output printed whole when it ends."""
    todo = list(groups)
    results: list[tuple[int, dict[str, int]]] = []
    lock = threading.Lock()  # the queue, the results and stdout

    def lane() -> None:
        while True:
            with lock:
                if not todo:
                    return
                group = todo.pop(0)
                print(f"=== {group.name}: started", flush=True)
            log = tmp / f"{group.name}.out"
            with log.open("w", encoding="utf-8") as out:
                result = run_group(group, tmp, out, NUM_LANES)
            with lock:
                sys.stdout.write(log.read_text(encoding="utf-8", errors="replace"))
                sys.stdout.flush()
                results.append(result)

    threads = [threading.Thread(target=lane) for _ in range(NUM_LANES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def select(names: list[str]) -> list[Group]:
    """The groups `names` ask for, in GROUPS' order (none: all); "e2e" selects both e2e
    groups."""
    return [g for g in GROUPS if not names or {g.name, g.name.split("-")[0]} & set(names)]


def main(argv: list[str]) -> int:
    serial = "--serial" in argv
    names = [a for a in argv if a != "--serial"]
    groups = select(names)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if serial:
            results = [run_group(g, Path(tmp)) for g in groups]
        else:
            results = run_lanes(groups, Path(tmp))
    total = {k: sum(c[k] for _, c in results) for k in ("passed", "failed", "skipped")}
    worst = any(rc != 0 for rc, _ in results)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped "
          f"in {time.monotonic() - start:.0f}s")  # fmt: skip
    if total["skipped"]:
        print("a test skipped: `make test` must install whatever a test needs (see -ra above)")
    return 1 if worst or total["failed"] or total["skipped"] or total["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
