"""Memory soak: mixed bursts against one engine for `--duration` seconds, every service's RSS
recorded over time (`make soak`; docs/RELIABILITY.md section 5).

    PYTHONPATH=. .venv/bin/python bench/soak.py \\
        --duration 600 --out results/soak

One engine (conveyor.launcher.LocalStack: tokenizer, scheduler, REAL worker in float32, HTTP
gateway when installed). Back-to-back bursts of `--burst-size` requests at once, each mixed:
random prompt lengths (8 to `--max-prompt-len` tokens) and output lengths (1 to
`--max-tokens`), greedy and seeded sampling, streamed or not, one in eight aborted after its
first chunk, one in eight through the HTTP gateway. After each burst the engine must be idle
again (no KV block in use). A sampler thread reads each service's VmRSS every `--interval` s.

With `--compare-untrimmed S` a first engine runs the same bursts for S seconds with the
worker's idle heap trim off (CONVEYOR_HEAP_TRIM=0, services/worker/heap.py): the growth it bounds.

Writes <out>/rss-<phase>.csv (time, burst, service, MiB), <out>/soak.json (per service: RSS
after the warm-up bursts, at the end, the largest after warm-up, growth; the worker's RSS after
each burst) and <out>/rss.png. Exit status 1 when a service's RSS after warm-up grows more than
`--bound-mib` (the documented bound) in the shipped configuration.
Run it alone on the machine: it loads the machine's cores for the whole duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from conveyor.launcher import LocalStack, StackSettings, gateway_available
from services.gateway.config import GatewayConfig
from services.worker.config import WorkerConfig
from shared.client import AsyncClient, Client, EngineError
from shared.config_flags import parse_size

SERVICES = ("tokenizer", "scheduler", "worker", "gateway")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of bursts")
    p.add_argument("--burst-size", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--warmup-bursts", type=int, default=3, help="bursts before the baseline")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--bound-mib", type=float, default=64.0,
                   help="allowed RSS growth per service after warm-up")  # fmt: skip
    p.add_argument("--kv-cache-memory", default="384MiB")
    p.add_argument("--compare-untrimmed", type=float, default=0.0,
                   help="first run this many seconds with CONVEYOR_HEAP_TRIM=0 (the worker keeps "
                   "glibc's caches), for a side-by-side figure")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    return p.parse_args(argv)


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (Linux /proc), NaN when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Sampler(threading.Thread):
    """Reads every service's RSS each `interval` s until stopped; rows (t, burst, service, MiB)."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.rows: list[tuple[float, int, str, float]] = []
        self.burst = 0
        self.t0 = time.monotonic()
        self._stop_event = threading.Event()

    def sample(self) -> dict[str, float]:
        now = time.monotonic() - self.t0
        values = {name: rss_mib(pid) for name, pid in self.pids.items()}
        self.rows += [(now, self.burst, name, mib) for name, mib in values.items()]
        return values

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()


def _request(rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    n = rng.randint(8, args.max_prompt_len)
    return {
        "prompt_token_ids": [rng.randint(100, 40000) for _ in range(n)],
        "max_tokens": rng.randint(1, args.max_tokens),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randint(0, 1 << 30),
        "ignore_eos": rng.random() < 0.5,
    }


async def _one(client: AsyncClient, params: dict[str, Any], kind: str, http: str | None) -> str:
    try:
        if kind == "abort":
            stream = client.stream(**params)
            async for _ in stream:
                await client.abort(stream.id)
                break
            async for _ in stream:  # until its final `done`
                pass
        elif kind == "http" and http is not None:
            body = {"prompt": params["prompt_token_ids"], "max_tokens": params["max_tokens"],
                    "temperature": params["temperature"], "seed": params["seed"]}  # fmt: skip
            req = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=600).read())
        else:
            await client.generate(stream=kind == "stream", **params)
        return "ok"
    except EngineError as exc:
        return exc.code


async def _burst(address: str, http: str | None, rng: random.Random, args: argparse.Namespace):
    kinds = ["abort", "http"] + ["stream", "plain", "stream", "plain", "stream", "plain"]
    async with AsyncClient(address, timeout=600.0) as client:
        jobs = [_one(client, _request(rng, args), kinds[i % len(kinds)], http)
                for i in range(args.burst_size)]  # fmt: skip
        return await asyncio.gather(*jobs)


def _wait_idle(address: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with Client(address, timeout=30.0) as client:
        while True:
            engine = client.stats().get("engine") or {}
            idle = engine.get("kv_blocks_used") == 0 and engine.get("num_running") == 0
            if idle or time.monotonic() > deadline:
                return engine
            time.sleep(0.2)


def summarize(rows: list, after_burst: dict[int, dict[str, float]], warmup: int, bound: float):
    """Per service: RSS after the warm-up bursts, at the end, the largest after warm-up."""
    out: dict[str, Any] = {}
    last = max(after_burst)
    for name in after_burst[last]:
        base = after_burst[min(warmup, last)][name]
        later = [mib for t, b, s, mib in rows if s == name and b > warmup]
        peak = max(later, default=base)
        end = after_burst[last][name]
        out[name] = {"after_warmup_mib": round(base, 1), "end_mib": round(end, 1),
                     "peak_after_warmup_mib": round(peak, 1), "growth_mib": round(end - base, 1),
                     "within_bound": end - base <= bound}  # fmt: skip
    return out


def plot(phases: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    styles = {"shipped": "-", "untrimmed": ":"}
    for phase, ph in phases.items():
        for name in sorted({s for _, _, s, _ in ph["rows"]}):
            if phase != "shipped" and name != "worker":
                continue  # only the worker differs between the phases
            pts = [(t / 60, mib) for t, _, s, mib in ph["rows"] if s == name]
            label = name if phase == "shipped" else f"{name} ({phase})"
            ax.plot(*zip(*pts, strict=True), styles[phase], label=label)
    ax.set_xlabel("minutes since the engine was ready")
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Conveyor soak: RSS per service under back-to-back mixed bursts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_phase(args: argparse.Namespace, duration: float, env: dict[str, str]) -> dict[str, Any]:
    """One engine, bursts for `duration` s (the same seeded sequence in every phase)."""
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    settings = StackSettings(
        frontend_address=f"ipc://{log_dir}/frontend.sock", gateway=gateway_available(),
        gateway_config=GatewayConfig(http_port=_free_port()), log_dir=log_dir,
        drain_timeout_s=5.0, env=env,
        worker_config=WorkerConfig(dtype="float32",
                                   kv_cache_memory=parse_size(args.kv_cache_memory)),
    )  # fmt: skip
    stack = LocalStack(settings).start()
    try:
        stack.wait_ready(timeout=900)
        pids = {n: stack.services[n].pid for n in SERVICES if n in stack.services}
        sampler = Sampler(pids, args.interval)
        sampler.start()
        after_burst, marks, outcomes = {0: sampler.sample()}, [], {}
        end = time.monotonic() + duration
        while time.monotonic() < end:
            sampler.burst += 1
            results = asyncio.run(_burst(stack.frontend_address, stack.http_url, rng, args))
            for code in results:
                outcomes[code] = outcomes.get(code, 0) + 1
            engine = _wait_idle(stack.frontend_address)
            if engine.get("kv_blocks_used") != 0:
                raise RuntimeError(f"KV blocks left in use after a burst: {engine}")
            time.sleep(1.0)  # the worker is idle now (it trims its heap after 0.5 s)
            after_burst[sampler.burst] = sampler.sample()
            marks.append(time.monotonic() - sampler.t0)
            print(f"burst {sampler.burst}: " + ", ".join(
                f"{n} {m:.0f}" for n, m in after_burst[sampler.burst].items()) + " MiB",
                flush=True)  # fmt: skip
        sampler.stop()
    finally:
        stack.stop()
    return {"rows": sampler.rows, "after_burst": after_burst, "marks": marks,
            "outcomes": outcomes, "num_bursts": sampler.burst, "log_dir": str(log_dir)}  # fmt: skip


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    phases = {}
    if args.compare_untrimmed > 0:
        print(f"untrimmed worker (CONVEYOR_HEAP_TRIM=0), {args.compare_untrimmed:g} s", flush=True)
        phases["untrimmed"] = run_phase(args, args.compare_untrimmed, {"CONVEYOR_HEAP_TRIM": "0"})
    print(f"as shipped (heap trimmed when idle), {args.duration:g} s", flush=True)
    phases["shipped"] = run_phase(args, args.duration, {})
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name, ph in phases.items():
        summary = summarize(ph["rows"], ph["after_burst"], args.warmup_bursts, args.bound_mib)
        worker = [round(v["worker"], 1) for _, v in sorted(ph["after_burst"].items())]
        report[name] = {"num_bursts": ph["num_bursts"], "outcomes": ph["outcomes"],
                        "services": summary, "log_dir": ph["log_dir"],
                        "worker_after_each_burst_mib": worker}  # fmt: skip
        with open(args.out / f"rss-{name}.csv", "w") as f:
            f.write("t_s,burst,service,rss_mib\n")
            f.writelines(f"{t:.1f},{b},{s},{m:.1f}\n" for t, b, s, m in ph["rows"])
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    plot(phases, args.out / "rss.png")
    print(json.dumps({n: report[n]["services"] for n in phases}, indent=2))
    shipped = report["shipped"]["services"]
    return 0 if all(s["within_bound"] for s in shipped.values()) else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
