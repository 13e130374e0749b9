"""The engine on a GPU, end to end, in one run that stops itself in time (`bench/gpu/e2e.sh`).

Stages, each a child process with its own time limit inside one overall limit (default 300 s):

1. `install`: the engine's missing dependencies from `.gpu/wheels` (`make gpu-wheels`) with
   `pip install --no-index --no-deps --target`, then every module imported from there;
2. `models` (beside `gpu_check`): random-weight SmolLM2-135M- and Llama-3.2-1B-shaped folders;
3. `gpu_check`: bench/gpu/check.sh (kernel checks, copy bandwidth, attention, engine step);
4. `correctness`: fp32 greedy = transformers, bf16 within tolerance, Triton = torch on the
   same plans (bench/gpu/e2e_correct.py);
5. `serve_*`: `conveyor up --device cuda` + `conveyor bench` bursts per model
   (bench/gpu/e2e_serve.py); `hf_static`: the same bursts through transformers' static
   `generate()` (bench/gpu/e2e_hf.py); last, `serve_smollm2-pipeline-off`: burst 256 again
   with the worker's step pipelining off (throughput and device idle, off against on);
6. the report: `$OUT/gpu_e2e.json` (every stage, `ok` each), `gpu_e2e.md` (the table),
   `gpu_e2e.log` (every child's output), `gpu_check.json`, `logs.tar.gz` (the services' logs).

`--dry-run` runs the same stages at tiny sizes on CPU (TRITON_INTERPRET=1, CUDA hidden,
`conveyor up --device cpu`); its figures mean nothing, it proves the script. Exit code 0 when
every stage passed. Standard library only: nothing is installed when it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: bench/ is found from the repository root
    sys.path.insert(0, str(ROOT))
from bench.gpu.e2e_plan import PLANS, Plan  # noqa: E402 - standard library only, like this
from bench.gpu.e2e_report import markdown, summarize  # noqa: E402

REPORT_RESERVE_S = 10.0  # kept back from the last stages for the report and the log archive
MIN_STAGE_S = 5.0  # a stage with less than this left is not started
KILL_GRACE_S = 5.0
POLL_S = 0.1
TAIL_LINES = 40  # of a failed stage's output, printed (a remote run shows the output's end)


@dataclass
class Stage:
    """One child process: its command, limit, and (after it ran) its outcome."""

    name: str
    argv: list[str]
    limit_s: float
    json_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    record: dict[str, Any] = field(default_factory=dict)


class Runner:
    """Runs stages under one overall deadline, logging their output to one file."""

    def __init__(self, time_limit_s: float, log_path: Path, env: dict[str, str]) -> None:
        self.deadline = time.monotonic() + time_limit_s
        self.log = open(log_path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.env = env
        self.stages: list[Stage] = []

    def left(self) -> float:
        return self.deadline - time.monotonic() - REPORT_RESERVE_S

    def start(self, stage: Stage) -> Stage:
        self.stages.append(stage)
        stage.limit_s = min(stage.limit_s, self.left())
        if stage.limit_s < MIN_STAGE_S:
            stage.record = {"ok": False, "note": "not started: no time left"}
            return stage
        self.log.write(f"\n===== {stage.name}: {' '.join(stage.argv)}\n")
        stage.started = time.monotonic()
        stage.proc = subprocess.Popen(
            stage.argv,
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return stage

    def finish(self, *stages: Stage) -> None:
        """Wait for the stages, each within its own limit (past it, its whole process group is
        killed); records each one's outcome as it ends."""
        pending = [(s, s.proc) for s in stages if s.proc is not None and not s.record]
        while pending:
            now = time.monotonic()
            for stage, proc in list(pending):
                rc = proc.poll()
                timed_out = rc is None and now > stage.started + stage.limit_s
                if rc is None and not timed_out:
                    continue
                if timed_out:
                    _kill_group(proc)
                stage.record = {
                    "ok": rc == 0,
                    "rc": rc,
                    "timed_out": timed_out,
                    "seconds": round(now - stage.started, 1),
                }
                pending.remove((stage, proc))
            time.sleep(POLL_S)
        for stage in stages:
            stage.record.update(name=stage.name, limit_s=round(stage.limit_s, 1))
            if not stage.record["ok"] and len(stages) == 1 and stage.proc is not None:
                self._print_tail(stage)
            print(
                f"gpu_e2e: {stage.name}: {'ok' if stage.record['ok'] else 'FAILED'} "
                f"{ {k: v for k, v in stage.record.items() if k not in ('name', 'ok')} }",
                flush=True,
            )

    def run(self, *stages: Stage) -> None:
        """Start the stages together and wait for all of them."""
        for stage in stages:
            self.start(stage)
        self.finish(*stages)

    def _print_tail(self, stage: Stage) -> None:
        """The last lines a failed stage wrote, so the run's printed output shows why."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        own = text[text.rfind(f"===== {stage.name}:") :].splitlines()
        print("\n".join(f"  | {line}" for line in own[-TAIL_LINES:]), flush=True)

    def abort(self) -> None:
        """Kill every stage still running and record it as interrupted."""
        for stage in self.stages:
            if stage.proc is not None and stage.proc.poll() is None:
                _kill_group(stage.proc)
            if not stage.record:
                stage.record = {"ok": False, "note": "interrupted", "name": stage.name,
                                "limit_s": round(stage.limit_s, 1)}  # fmt: skip

    def close(self) -> None:
        self.log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the stage's process group (a stack drains on it), SIGKILL what is left after
    KILL_GRACE_S; returns once the group is gone, so the next stage finds the device free."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(POLL_S)
        if not _group_alive(proc):
            break
    proc.wait()


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader, else it stays a zombie member of its group
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def py(module: str, *args: Any) -> list[str]:
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def helper(name: str, module: str, limit_s: float, work: Path, *args: Any) -> Stage:
    """A stage running `python -m module args... --json work/<name>.json`."""
    json_path = work / f"{name}.json"
    return Stage(name, py(module, *args, "--json", json_path), limit_s, json_path)


def stage_list(plan: Plan, work: Path, out: Path, site: Path) -> dict[str, Stage]:
    """Every stage's command for this plan (models and JSON under work/)."""
    models, limits = work / "models", plan.limits
    wheels = ROOT / ".gpu" / "wheels"
    dry = plan.dry_run
    check = [ROOT / "bench" / "gpu" / "check.sh", "--out", out / "gpu_check.json", "--time-limit",
             plan.check_soft_limit_s, *(["--dry-run"] if dry else [])]  # fmt: skip
    stages = {
        "install": helper("install", "bench.gpu.e2e_pack", limits["install"], work, "install",
                          "--wheels", wheels, "--target", site, *(["--cross"] if dry else [])),
        # drawn on the CPU: the GPU is busy with gpu_check's timings meanwhile
        "models": helper("models", "bench.gpu.e2e_models", limits["models"], work, "--out",
                         models, "--device", "cpu", *(["--tiny"] if dry else [])),
        "gpu_check": Stage("gpu_check", [str(a) for a in check], limits["gpu_check"],
                           out / "gpu_check.json"),
        "correctness": helper("correctness", "bench.gpu.e2e_correct", limits["correctness"],
                              work, "--model", models / "smollm2", "--extra-model",
                              models / "llama-1b", "--device", plan.device, *plan.correct_args),
    }  # fmt: skip
    runs: list[Any] = []
    for kind, served in plan.serving.items():
        stages[f"serve_{kind}"] = helper(
            f"serve_{kind}", "bench.gpu.e2e_serve", served.serve_limit_s, work,
            "--model", models / kind, "--device", plan.device, "--dtype", plan.dtype,
            "--bursts", served.bursts, "--scale", served.scale, *served.serve_args,
            "--log-dir", work / f"logs-{kind}",
        )  # fmt: skip
        runs += ["--run", kind, models / kind, served.bursts, served.scale]
        if served.pipeline_off_bursts is not None:
            name = f"serve_{kind}-pipeline-off"
            stages[name] = helper(
                name, "bench.gpu.e2e_serve", served.serve_limit_s, work,
                "--model", models / kind, "--device", plan.device, "--dtype", plan.dtype,
                "--bursts", served.pipeline_off_bursts, "--scale", served.scale,
                *served.serve_args, "--pipeline-steps", "off",
                "--log-dir", work / f"logs-{kind}-pipeline-off",
            )  # fmt: skip
    stages["hf_static"] = helper("hf_static", "bench.gpu.e2e_hf", limits["hf_static"], work,
                                 *runs, "--device", plan.device, "--dtype", plan.dtype)  # fmt: skip
    return stages


def run_all(
    runner: Runner, stages: dict[str, Stage], plan: Plan, stage_done: Callable[[], None]
) -> None:
    """The order (bench/gpu/e2e_plan.py): install; models beside gpu_check; each model served;
    the transformers reference; correctness; the pipelining comparison last (all of those side
    by side when the plan says so). `stage_done` is called as each step ends (partial report)."""
    runner.run(stages["install"])
    stage_done()
    if stages["install"].record["ok"] and not plan.dry_run:  # later stages import from there
        site = stages["install"].argv[stages["install"].argv.index("--target") + 1]
        runner.env["PYTHONPATH"] = os.pathsep.join([site, runner.env["PYTHONPATH"]])
    runner.run(stages["models"], stages["gpu_check"])
    stage_done()
    gateway = _read(stages["install"].json_path).get("gateway", False)
    later = []
    for kind in plan.serving:
        if not gateway:  # fastapi/uvicorn did not import: serve over ZeroMQ alone
            stages[f"serve_{kind}"].argv.append("--no-gateway")
        later.append(stages[f"serve_{kind}"])
    later.append(stages["hf_static"])  # after the stacks: the GPU is free of their KV caches
    later.append(stages["correctness"])
    # the pipelining comparison last: the overall deadline trims it before anything else
    for name in [n for n in stages if n.endswith("-pipeline-off")]:
        if not gateway:
            stages[name].argv.append("--no-gateway")
        later.append(stages[name])
    if plan.parallel:
        runner.run(*later)
        stage_done()
    else:
        for stage in later:
            runner.run(stage)
            stage_done()


def _read(path: Optional[Path]) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def environment(plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", PYTHON=sys.executable)
    if plan.dry_run:  # CPU only, kernels interpreted, few threads on a shared machine
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "results" / "gpu_e2e")
    )
    p.add_argument(
        "--work", type=Path, help="scratch folder, kept (default: a temporary one, removed)"
    )
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    p.add_argument("--time-limit", type=float, help="overall seconds (default: the plan's)")
    p.add_argument(
        "--check-time-limit", type=float, help="gpu_check's own soft limit (default: the plan's)"
    )
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    plan = PLANS["dry-run" if args.dry_run else "device"]
    if args.check_time_limit is not None:
        plan = dataclasses.replace(plan, check_soft_limit_s=args.check_time_limit)
    limit = args.time_limit if args.time_limit is not None else plan.time_limit_s
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="conveyor-gpu-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.monotonic()
    runner = Runner(limit, args.out / "gpu_e2e.log", environment(plan))
    stages = stage_list(plan, work, args.out, work / "site")
    head = {"mode": plan.name, "started": started, "time_limit_s": limit,
            "host": _host_facts(plan)}  # fmt: skip

    def write_report(partial: bool) -> dict[str, Any]:
        report = _report(head, runner, stages, partial)
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        (args.out / "gpu_e2e.json").write_text(json.dumps(report, indent=2))
        return report

    try:
        run_all(runner, stages, plan, lambda: write_report(partial=True))
    except KeyboardInterrupt:  # Ctrl-C: no stage outlives the run (each has its own session)
        runner.abort()
    finally:
        runner.close()
    report = write_report(partial=False)
    table = markdown(report)
    (args.out / "gpu_e2e.md").write_text(table)
    _archive_logs(work, args.out / "logs.tar.gz")
    if args.work is None:  # our own scratch folder: the model folders are gigabytes on a GPU
        shutil.rmtree(work, ignore_errors=True)
    print(table, flush=True)
    print(
        f"gpu_e2e: {'ALL STAGES OK' if report['ok'] else 'SOME STAGES FAILED'} in "
        f"{report['elapsed_s']} s; wrote {args.out}",
        flush=True,
    )
    return 0 if report["ok"] else 1


def _report(
    head: dict[str, Any], runner: Runner, stages: dict[str, Stage], partial: bool
) -> dict[str, Any]:
    """gpu_e2e.json: the stages run so far with their results; `partial` while more follow (a
    run cut short keeps the last one written)."""
    done = [s for s in runner.stages if s.record]
    report = dict(head, partial=partial, stages=[s.record for s in done],
                  results={s.name: _read(s.json_path) for s in done})  # fmt: skip
    report["summary"] = summarize(report)
    report["ok"] = (not partial and all(s["ok"] for s in report["stages"])
                    and len(report["stages"]) == len(stages))  # fmt: skip
    return report


def _host_facts(plan: Plan) -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0]}
    for key, cmd in (
        (
            "gpu",
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        ),
        ("commit", ["git", "rev-parse", "--short", "HEAD"]),
    ):
        if key == "gpu" and plan.dry_run:
            continue
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10)
            facts[key] = done.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            facts[key] = None
    return facts


def _archive_logs(work: Path, dest: Path) -> None:
    """The services' logs and the bench outputs, as one file (fewer files to copy back)."""
    with tarfile.open(dest, "w:gz") as tar:
        for folder in sorted(work.glob("logs-*")):
            tar.add(folder, arcname=folder.name)


if __name__ == "__main__":
    sys.exit(main())
