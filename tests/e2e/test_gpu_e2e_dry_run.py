"""`bench/gpu/e2e.sh --dry-run`: the GPU end-to-end script, every stage, at tiny sizes on CPU.

The script is what a GPU machine runs, once, in one go; this keeps it from rotting.
It runs for real: the wheel pack is installed (for the device's tags, into a scratch folder) or,
without a pack, the modules are checked; random-weight folders are built; gpu_check runs a few
kernel checks under the interpreter; the correctness checks compare against transformers; two
`conveyor up --device cpu` stacks serve `conveyor bench` bursts; transformers' static generate()
runs the same bursts. Runtime ~25-45 s on 2 cores (the stages after the models run side by side
in a dry run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    "install",
    "models",
    "gpu_check",
    "serve_smollm2",
    "serve_llama-1b",
    "hf_static",
    "correctness",
]
OUT_FILES = {"gpu_e2e.json", "gpu_e2e.md", "gpu_e2e.log", "gpu_check.json", "logs.tar.gz"}


def test_dry_run_lists_every_stage_ok(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the script finds the repository by itself
    proc = subprocess.run(
        [
            str(ROOT / "bench" / "gpu" / "e2e.sh"),
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (out / "gpu_e2e.log").read_text() if (out / "gpu_e2e.log").exists() else ""
    report = json.loads((out / "gpu_e2e.json").read_text())
    failed = [s for s in report["stages"] if not s["ok"]]
    assert not failed, f"{failed}\n{proc.stdout[-3000:]}\n{log[-6000:]}"
    assert [s["name"] for s in report["stages"]] == STAGES
    assert report["ok"] and proc.returncode == 0 and report["mode"] == "dry-run"
    assert not report["partial"]
    # what comes back from a device is at most 8 files: these
    assert {p.name for p in out.iterdir()} == OUT_FILES

    results = report["results"]
    assert results["install"]["modules"]["zmq"]["ok"] and results["install"]["gateway"]
    assert set(results["models"]["models"]) == {"smollm2", "llama-1b"}
    checks = results["correctness"]["checks"]
    assert len(checks) == 5 and all(c["ok"] for c in checks.values())
    assert checks["greedy_fp32_vs_transformers"]["num_prompts"] == 2
    for kind in ("smollm2", "llama-1b"):
        bursts = results[f"serve_{kind}"]["bursts"]
        assert [b["burst"] for b in bursts] == [2, 4]
        for b in bursts:
            assert b["completed"] == b["burst"] and b["failed"] == 0
            assert b["output_throughput"] > 0 and b["steps"]["all"]["num_steps"] >= 1
        assert results[f"serve_{kind}"]["up_exit_code"] == 0  # stopped cleanly
        hf_bursts = results["hf_static"]["models"][kind]["bursts"]
        assert [b["burst"] for b in hf_bursts] == [2, 4] and all(b["ok"] for b in hf_bursts)
    rows = report["summary"]["serving"]
    assert len(rows) == 4 and all(r["speedup"] is not None for r in rows)
    table = (out / "gpu_e2e.md").read_text()
    assert "| smollm2 | 4 |" in table and "| llama-1b | 4 |" in table
    assert "continuous_vs_static" in table
    assert proc.stdout.rstrip().splitlines()[-1].startswith("gpu_e2e: ALL STAGES OK")
