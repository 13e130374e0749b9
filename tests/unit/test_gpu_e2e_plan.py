"""The GPU end-to-end run's plan and stage runner, checked without a GPU.

The device plan is only ever run on a GPU machine, once: every command it would start must
already parse with the program it starts (a wrong flag would cost the whole GPU run), and
the runner must stop a stage past its limit, its children included, and start none once the
overall deadline is near.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench.gpu import e2e_correct as gpu_e2e_correct
from bench.gpu import e2e_hf as gpu_e2e_hf
from bench.gpu import e2e_models as gpu_e2e_models
from bench.gpu import e2e_pack as gpu_e2e_pack
from bench.gpu import e2e_serve as gpu_e2e_serve
from bench.gpu.check import parse_args as gpu_check_args
from bench.gpu.e2e import MIN_STAGE_S, REPORT_RESERVE_S, Runner, Stage, _report, stage_list
from bench.gpu.e2e_plan import PLANS, sequential_limit_s
from bench.gpu.e2e_report import markdown, summarize
from conveyor.cli import build_parser
from tests.bounds import SLOW_HOST_MARGIN_S

PARSERS = {
    "bench.gpu.e2e_pack": gpu_e2e_pack.parse_args,
    "bench.gpu.e2e_models": gpu_e2e_models.parse_args,
    "bench.gpu.e2e_correct": gpu_e2e_correct.parse_args,
    "bench.gpu.e2e_serve": gpu_e2e_serve.parse_args,
    "bench.gpu.e2e_hf": gpu_e2e_hf.parse_args,
}


@pytest.mark.parametrize("mode", sorted(PLANS))
def test_every_stage_command_parses(mode: str, tmp_path: Path) -> None:
    plan = PLANS[mode]
    stages = stage_list(plan, tmp_path / "work", tmp_path / "out", tmp_path / "site")
    assert list(stages) == [
        "install",
        "models",
        "gpu_check",
        "correctness",
        *(
            name
            for k, served in plan.serving.items()
            for name in [f"serve_{k}"]
            + ([f"serve_{k}-pipeline-off"] if served.pipeline_off_bursts else [])
        ),
        "hf_static",
    ]
    for stage in stages.values():
        if stage.name == "gpu_check":
            args = gpu_check_args(stage.argv[1:])
            assert args.dry_run == plan.dry_run and args.time_limit == plan.check_soft_limit_s
            continue
        module = stage.argv[stage.argv.index("-m") + 1]
        PARSERS[module](stage.argv[stage.argv.index("-m") + 2 :])
    serve_args = gpu_e2e_serve.parse_args(stages["serve_llama-1b"].argv[3:])
    up = gpu_e2e_serve.up_command(serve_args, "tcp://127.0.0.1:5999", 8999)
    parsed = build_parser().parse_args(up[up.index("up") :])
    assert parsed.device == plan.device and parsed.max_num_seqs == max(serve_args.bursts)
    assert parsed.max_num_batched_tokens >= parsed.max_num_seqs
    if plan.serving["smollm2"].pipeline_off_bursts:  # the comparison stage turns it off
        off = gpu_e2e_serve.parse_args(stages["serve_smollm2-pipeline-off"].argv[3:])
        up = gpu_e2e_serve.up_command(off, "tcp://127.0.0.1:5999", 8999)
        assert build_parser().parse_args(up[up.index("up") :]).pipeline_steps == "off"


def test_device_plan_serves_the_issue_bursts() -> None:
    plan = PLANS["device"]
    assert plan.device == "cuda" and plan.time_limit_s <= 300
    assert plan.serving["smollm2"].bursts == "64,256"
    assert plan.serving["llama-1b"].bursts == "256,1024"
    # gpu_check stops itself (soft limit + its 20 s alarm) inside its stage limit
    assert plan.check_soft_limit_s + 20 < plan.limits["gpu_check"]


def test_device_plan_fits_its_deadline() -> None:
    # the stages run one after another fit the overall limit with the report's reserve (the
    # pipelining comparison runs last on what is left), and each stack is ready in its stage
    plan = PLANS["device"]
    assert sequential_limit_s(plan) + REPORT_RESERVE_S <= plan.time_limit_s
    for served in plan.serving.values():
        args = served.serve_args
        assert float(args[args.index("--ready-timeout") + 1]) < served.serve_limit_s


def test_partial_report_lists_the_stages_that_ended(tmp_path: Path) -> None:
    runner = Runner(120.0, tmp_path / "log", dict(os.environ))
    done = Stage("first", [sys.executable, "-c", "pass"], limit_s=60.0)
    later = Stage("second", [sys.executable, "-c", "pass"], limit_s=60.0)
    runner.run(done)
    runner.stages.append(later)  # started, not ended: left out of the partial report
    runner.close()
    report = _report({"mode": "test"}, runner, {"first": done, "second": later}, partial=True)
    assert report["partial"] and not report["ok"]
    assert [s["name"] for s in report["stages"]] == ["first"]
    assert report["stages"][0]["ok"] and set(report["results"]) == {"first"}


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    runner = Runner(120.0, tmp_path / "log", dict(os.environ))
    stage = Stage("sleepy", [sys.executable, "-c", code], limit_s=MIN_STAGE_S)
    start = time.monotonic()
    runner.run(stage)
    runner.close()
    assert stage.record["timed_out"] and not stage.record["ok"]
    assert time.monotonic() - start < MIN_STAGE_S + SLOW_HOST_MARGIN_S
    child = int(pid_file.read_text())
    deadline = time.monotonic() + SLOW_HOST_MARGIN_S
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_no_stage_starts_when_the_deadline_is_near(tmp_path: Path) -> None:
    runner = Runner(REPORT_RESERVE_S + MIN_STAGE_S / 2, tmp_path / "log", dict(os.environ))
    stage = Stage("late", [sys.executable, "-c", "pass"], limit_s=60.0)
    runner.run(stage)
    runner.close()
    assert stage.proc is None and not stage.record["ok"]
    assert "no time left" in stage.record["note"]


def test_goals_are_judged_on_the_worst_case() -> None:
    burst = {
        "burst": 256,
        "ok": True,
        "output_throughput": 3000.0,
        "median_ttft_ms": 10.0,
        "steps": {
            "all": {"mean_step_ms": 5.0},
            "full_batch": {"mean_period_ms": 6.0, "outside_forward_share": 0.12},
        },
    }
    report = {
        "mode": "device",
        "started": "now",
        "host": {},
        "stages": [],
        "results": {
            "gpu_check": {
                "decode_attention": [
                    {"batch": 1, "context": 1024, "head_dim": 64, "pct_copy": 90.0},
                    {"batch": 256, "context": 8192, "head_dim": 64, "pct_copy": 85.0},
                ]
            },
            "serve_smollm2": {"bursts": [burst]},
            "serve_llama-1b": {
                "bursts": [{**burst, "steps": {"full_batch": {"outside_forward_share": 0.05}}}]
            },
            "hf_static": {
                "models": {"smollm2": {"bursts": [{"burst": 256, "output_throughput": 1000.0}]}}
            },
        },
    }
    goals = summarize(report)["goals"]
    assert goals["decode_attention_vs_copy"]["value"] == 85.0  # the largest decode, not batch 1
    assert goals["overhead_at_256"]["value"] == 0.12 and goals["overhead_at_256"]["met"] is False
    assert goals["continuous_vs_static"]["value"] == 3.0 and goals["continuous_vs_static"]["met"]
    report["summary"] = summarize(report)
    assert "| smollm2 | 256 | 3,000 |" in markdown(report)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split()[2] != "Z"


def test_device_time_is_the_difference_over_the_burst(tmp_path: Path) -> None:
    """The worker's cumulative `device_time` lines (CUDA only) -> idle and busy per step over
    the burst's window; lines outside it and other workers' events are left out."""
    lines = [
        {"event": "device_time", "t": 9.0, "num_steps": 32, "busy_s": 0.1, "idle_s": 0.5},
        {"event": "device_time", "t": 10.5, "num_steps": 64, "busy_s": 0.2, "idle_s": 0.6},
        {"event": "step_failed", "t": 11.0},
        {
            "event": "device_time",
            "t": 12.0,
            "num_steps": 128,
            "busy_s": 0.5,
            "idle_s": 0.7,
            "idle_p50_us": 40.0,
        },  # fmt: skip
        {"event": "device_time", "t": 30.0, "num_steps": 160, "busy_s": 0.6, "idle_s": 9.0},
    ]
    (tmp_path / "worker.log").write_text("".join(json.dumps(r) + "\n" for r in lines) + "{torn")
    got = gpu_e2e_serve.device_time(tmp_path, 10.0, 20.0)
    assert got is not None and got["num_steps"] == 64 and got["last_idle_p50_us"] == 40.0
    assert got["idle_share"] == pytest.approx(0.1 / 0.4)
    assert got["mean_idle_us"] == pytest.approx(1e6 * 0.1 / 64)
    assert gpu_e2e_serve.device_time(tmp_path, 0.0, 9.5) is None  # one line: no difference
