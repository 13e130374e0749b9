"""The house style's mechanical part holds on every commit: ruff's lint and format at 100 columns.

`make lint` runs the same two commands; here they are part of `make test`, so a line over 100
columns or an unformatted file fails the run instead of waiting for someone to lint by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUFF = [sys.executable, "-m", "ruff"]


def _tracked_python_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return [name for name in out.split() if (ROOT / name).exists()]


def test_ruff_check_passes() -> None:
    proc = subprocess.run([*RUFF, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_ruff_format_check_passes() -> None:
    cmd = [*RUFF, "format", "--check", *_tracked_python_files()]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
