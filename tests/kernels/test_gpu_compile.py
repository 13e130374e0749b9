"""Every kernel compiles for a Hopper GPU (sm_90) here, with no GPU, and spills no registers.

Interpreter tests run the kernels' Python, not the compiler; bench/gpu/compile.py compiles each
kernel ahead of time to a cubin with the launch shapes the launchers choose on a GPU and reads
its resource usage. Runtime ~15 s of CPU the first time (Triton caches compiled kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "bench/gpu/compile.py", "--json", "--arch", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"write_kv", "silu_and_mul", "merge splits d128"} <= set(results)
    for label, usage in results.items():
        assert "error" not in usage, f"{label}: {usage.get('error')}"
        assert usage["stack_bytes"] == 0, f"{label} spills registers: {usage}"
    assert proc.returncode == 0, proc.stderr[-2000:]
