"""Only the worker imports torch: the scheduler process, the launcher and the CLI stay light
(one thread each, the cores left to the worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    ["services.scheduler.__main__", "services.scheduler.server", "services.worker.loop",
     "shared.transport", "services.worker.__main__", "conveyor.cli", "conveyor.launcher",
     "conveyor.healthcheck"],
)  # fmt: skip
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
