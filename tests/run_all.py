"""`make test`: each test group in its own pytest process, then one closing line.

Kernel tests run under the Triton interpreter in their own process: an out-of-bounds load there
segfaults, which must show up as a failed group, not take the other groups down.

A skipped test fails the run: `make test` installs whatever a test needs, so a skip can only
mean a test that did not check what it claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, paths, extra environment)
GROUPS: list[tuple[str, list[str], dict[str, str]]] = [
    ("unit", ["tests/unit"], {}),
    ("kernels", ["tests/kernels"], {"TRITON_INTERPRET": "1"}),
    ("e2e", ["tests/e2e"], {}),
]


def run_group(
    name: str, paths: list[str], extra_env: dict[str, str], xml: Path
) -> tuple[int, dict]:
    env = {**os.environ, **extra_env}
    existing = [p for p in paths if (ROOT / p).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", *existing]
    print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            tests = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts["passed"] += tests - failed - skipped
            counts["failed"] += failed
            counts["skipped"] += skipped
    if rc not in (0, 1) and counts["failed"] == 0:
        counts["failed"] += 1  # crashed (e.g. a segfault) or collected nothing (exit 5)
    print(f"=== {name}: rc={rc} {counts} in {time.monotonic() - start:.0f}s", flush=True)
    return rc, counts


def main() -> int:
    selected = sys.argv[1:] or [g[0] for g in GROUPS]
    total = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, paths, extra in GROUPS:
            if name not in selected:
                continue
            rc, counts = run_group(name, paths, extra, Path(tmp) / f"{name}.xml")
            worst = worst or (rc != 0)
            for k in total:
                total[k] += counts[k]
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    if total["skipped"]:
        print("a test skipped: `make test` must install whatever a test needs (see -ra above)")
    return 1 if worst or total["failed"] or total["skipped"] or total["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
