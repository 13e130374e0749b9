"""Installing the project prints no deprecation warnings: pyproject.toml is built by the
installed setuptools (the metadata is what warns, e.g. `project.license` as a TOML table, so a
copy of pyproject.toml and the README is enough). Runtime ~3 s."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_building_the_project_prints_no_deprecation_warning(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
            "-w", str(tmp_path / "wheel"), str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    warned = [line for line in output.splitlines() if "deprecat" in line.lower()]
    assert not warned, "\n".join(warned)
    assert list((tmp_path / "wheel").glob("conveyor-*.whl"))
