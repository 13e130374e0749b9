"""`conveyor bench` against a live engine (the session's shared `engine` fixture), tiny sizes.

Eight mixed-length requests at 4 % of the seeds' lengths (prompts 1-20 tokens, outputs 1-10),
EOS ignored so every output length is known in advance. Checks the JSON (vLLM's field names,
token totals exact), the pictures (valid PNGs; one timeline row per request), and the same
workload through the OpenAI-compatible backend via a gateway process started here.
Rough runtime: 20-60 s on the shared 2-core machine (mostly process start-up and plotting).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from conveyor.bench.cli import main
from conveyor.bench.workloads import WorkloadConfig, generate

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORKLOAD = WorkloadConfig(name="mixed", num_prompts=8, scale=0.04, seed=3)
ARGS = ["--workload", "mixed", "--num-prompts", "8", "--scale", "0.04", "--seed", "3",
        "--ignore-eos", "--no-progress"]  # fmt: skip


def _result(out: Path) -> dict[str, Any]:
    return orjson.loads((out / "result.json").read_bytes())


def _check_totals(result: dict[str, Any]) -> None:
    reqs = generate(WORKLOAD)
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["total_output_tokens"] == sum(r.max_tokens for r in reqs)
    assert result["output_lens"] == [r.max_tokens for r in reqs]
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0


def test_bench_run_writes_vllm_named_json_and_pictures(engine: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = main(["--address", engine.frontend_address, "--log-dir", str(engine.log_dir), *ARGS,
               "--goodput", "e2el:600000", "--out", str(out)])  # fmt: skip
    assert rc == 0
    result = _result(out)
    _check_totals(result)
    for name in (
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p90_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "std_e2el_ms",
        "duration",
    ):
        assert isinstance(result[name], (int, float)), name  # fmt: skip
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["command"].startswith("conveyor bench --address")
    for png in ("cdf.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert result["figures"]["timeline_rows"] == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_same_workload_through_the_openai_backend(engine: Any, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "services.gateway", "--frontend-addr", engine.frontend_address,
           "--port", str(port), "--served-model-name", "bench-model",
           "--log-level", "warning"]  # fmt: skip
    gateway = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", gateway)
        out = tmp_path / "openai"
        rc = main(["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
                   "--model", "bench-model", *ARGS, "--no-plots", "--out", str(out)])  # fmt: skip
        assert rc == 0
        result = _result(out)
        _check_totals(result)
        assert result["backend"] == "openai"
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited"
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")
