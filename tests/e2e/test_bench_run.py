"""`conveyor bench` against a live engine (the session's shared `engine` fixture), tiny sizes.

Eight mixed-length requests at 4 % of the mixed lengths (prompts 1-20 tokens, outputs 1-10),
EOS ignored so every output length is known in advance. Checks the JSON (vLLM's field names,
token totals exact), the pictures (valid PNGs; one timeline row per request), and the same
workload through the OpenAI-compatible backend (the engine's gateway, or one started here).
The last two run `--compare-batching` and `--compare step_composition=...` on the simulated
worker (two and three engine starts).
Rough runtime: 60-150 s on the shared 2-core machine (process start-ups, real-model steps, plots).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from conveyor.bench.cli import main
from conveyor.bench.steplog import read_step_log
from conveyor.bench.workloads import WorkloadConfig, generate

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORKLOAD = WorkloadConfig(name="mixed", num_prompts=8, scale=0.04, seed=3)
ARGS = [
    "--workload",
    "mixed",
    "--num-prompts",
    "8",
    "--scale",
    "0.04",
    "--seed",
    "3",
    "--ignore-eos",
    "--no-progress",
]


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
    rc = main(
        [
            "--address",
            engine.frontend_address,
            "--log-dir",
            str(engine.log_dir),
            *ARGS,
            "--goodput",
            "e2el:600000",
            "--out",
            str(out),
        ]
    )
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
        assert isinstance(result[name], (int, float)), name
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
    with _gateway(engine) as base_url:
        models = httpx.get(f"{base_url}/v1/models", timeout=10.0, trust_env=False).json()
        out = tmp_path / "openai"
        rc = main(
            [
                "--backend",
                "openai",
                "--base-url",
                base_url,
                "--model",
                models["data"][0]["id"],
                *ARGS,
                "--no-plots",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    result = _result(out)
    _check_totals(result)
    assert result["backend"] == "openai"


@contextlib.contextmanager
def _gateway(engine: Any) -> Iterator[str]:
    """The engine's own gateway when it runs one; else a gateway process started here."""
    if engine.http_url is not None:
        yield engine.http_url
        return
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.gateway",
        "--frontend-addr",
        engine.frontend_address,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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


def test_compare_batching_runs_each_mode_on_its_own_engine(tmp_path: Path) -> None:
    """The `make bench` path on the SIMULATED worker (H200, Llama-3-8B: ~5 ms steps, no model to
    load), shrunk to one scenario and two modes: the table, JSON, markdown and pictures."""
    out = tmp_path / "compare"
    rc = main(
        [
            "--compare-batching",
            "--worker",
            "sim",
            "--sim-device",
            "h200",
            "--sim-model",
            "llama-3-8b",
            "--scenarios",
            "mixed",
            "--modes",
            "static,continuous",
            "--num-prompts",
            "8",
            "--scale",
            "0.1",
            "--batch-size",
            "4",
            "--no-progress",
            "--engine-timeout",
            "180",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = orjson.loads((out / "compare.json").read_bytes())
    assert report["command"].startswith("conveyor bench --compare-batching --worker sim")
    assert report["config"]["sim_device"] == "h200"
    static, cont = report["table"]
    assert (static["batching"], cont["batching"]) == ("static", "continuous")
    assert static["done"] == cont["done"] == 8
    assert static["x static"] == 1.0 and cont["x static"] > 0
    assert cont["model x"] > 0 and cont["packing x"] >= cont["model x"] * 0.5
    # Static keeps finished requests' slots: some of its slot-steps are padding.
    assert static["useful util"] < static["batch util"]
    for mode in ("static", "continuous"):
        run = report["runs"]["mixed"][mode]
        assert run["timeline_rows"] == 8
        assert (out / f"timeline-mixed-{mode}.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "cdf-mixed.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "compare.md").read_text().startswith("`conveyor bench --compare-batching")


def test_compare_any_setting_runs_the_flags_workload_on_each_engine(tmp_path: Path) -> None:
    """`--compare step_composition=...` on the SIMULATED worker: long prompts arriving into
    running decodes, one engine per composition; the latency table, and each engine's step log
    has its composition's shape (decode-first and prefill-first never mix prompt chunks with
    decodes in one forward; mixed does here)."""
    out = tmp_path / "compositions"
    values = ["mixed", "prefill-first", "decode-first"]
    rc = main(
        ["--compare", "step_composition=" + ",".join(values), "--worker", "sim",
         "--sim-device", "h200", "--sim-model", "llama-3-8b", "--workload", "uniform",
         "--input-len", "1024", "--output-len", "24", "--num-prompts", "6",
         "--request-rate", "40", "--ignore-eos", "--engine-flag", "max_num_batched_tokens=512",
         "--engine-flag", "chunk_size=512", "--no-progress", "--engine-timeout", "180",
         "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    report = orjson.loads((out / "compare.json").read_bytes())
    assert [r["step_composition"] for r in report["table"]] == values
    for row in report["table"]:
        assert row["done"] == 6 and row["TTFT p50 s"] > 0 and row["ITL max ms"] >= row["ITL p99 ms"]
    assert report["table"][0]["x mixed"] == 1.0
    assert (out / "steps-uniform.png").read_bytes()[:8] == PNG_MAGIC
    shapes = {}
    for value in values:
        steps = read_step_log(out / "logs" / value / "scheduler.log")
        shapes[value] = {(not s.is_decode_only, not any(s.is_prefill) or all(s.is_prefill))
                         for s in steps}  # fmt: skip
        assert (out / f"timeline-uniform-{value}.png").read_bytes()[:8] == PNG_MAGIC
    assert (True, False) in shapes["mixed"]  # a prompt chunk beside decodes
    assert shapes["prefill-first"] == shapes["decode-first"] == {(True, True), (False, True)}
