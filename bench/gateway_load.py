"""Load on the HTTP gateway (docs/RELIABILITY.md §8): `--connections` concurrent HTTP
connections, each sending completions back to back for `--duration` seconds, against one
engine whose capacity is below that (the gateway admits `--capacity` engine requests per
client, as `--max-requests-per-client`; every connection here is the same client address),
while a probe asks `/health` every `--probe-every` s on its own connection.

    PYTHONPATH=. .venv/bin/python bench/gateway_load.py --connections 1000 --duration 60

The engine: LocalStack with the SIMULATED worker (H200 step times: what is measured is the
gateway and the frontend, on this machine's CPU, not the model). The load client and the probe
are processes of their own (bench/gateway_load_client.py: raw asyncio streams, no HTTP
library; the client pinned to `--client-cpu`); the CPU seconds each process took are reported.
Passes when:

* every `/health` answers 200 within `--health-within` s (1 s);
* every request past capacity gets 429 or 503 (its latency is reported: median, p99, max),
  never a time-out;
* every admitted request (200) completes with its `max_tokens` tokens: none fails.

`--py-spy DIR` also samples the gateway's CPU (py-spy, a bench tool: `.venv/bin/pip install
py-spy`) over the middle of the run and prints its functions by CPU time.
Writes <out>/gateway-load.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from bench.pyspy_top import py_spy_binary
from conveyor.launcher import LocalStack, StackSettings
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig

CLIENT = Path(__file__).with_name("gateway_load_client.py")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--capacity", type=int, default=256, help="engine requests admitted at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probe-every", type=float, default=0.1)
    p.add_argument("--health-within", type=float, default=1.0)
    p.add_argument("--backoff", type=float, default=0.2, help="seconds a refused user waits")
    p.add_argument("--client-cpu", type=int, default=1, help="CPU the load client is pinned to")
    p.add_argument("--py-spy", type=Path, default=None, help="sample the gateway into DIR")
    p.add_argument("--out", type=Path, default=Path("results/gateway-load"))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median_s": round(statistics.median(ordered), 4), "p99_s": round(p99, 4),
            "max_s": round(ordered[-1], 4), "n": len(ordered)}  # fmt: skip


def _spawn(mode: str, port: int, args: argparse.Namespace, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, str(CLIENT), mode, "--port", str(port),
            "--duration", str(args.duration), *extra]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE)


def _py_spy(pid: int, args: argparse.Namespace) -> Optional[subprocess.Popen]:
    """py-spy on the gateway over the middle half of the run (after the connections opened)."""
    if args.py_spy is None:
        return None
    args.py_spy.mkdir(parents=True, exist_ok=True)
    delay, span = args.duration / 4, max(1, int(args.duration / 2))
    out = args.py_spy / "gateway.txt"
    cmd = (f"sleep {delay}; exec {py_spy_binary()} record --pid {pid} --duration {span} "
           f"--rate 100 --nonblocking --function --format raw -o {out}")  # fmt: skip
    return subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_self(raw: Path, limit: int = 25) -> list[str]:
    """The functions with the most samples of their own (the stack's last frame), and the share
    of all samples each took."""
    own: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        own[stack.rsplit(";", 1)[-1]] += int(count)
    total = sum(own.values()) or 1
    return [f"{100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(limit)]


def run(port: int, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """The probe and the load client against the gateway; their results and every process's
    CPU seconds over the run."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    probe = _spawn("probe", port, args, "--probe-every", str(args.probe_every))
    client = _spawn("load", port, args, "--connections", str(args.connections),
                    "--max-tokens", str(args.max_tokens), "--backoff", str(args.backoff),
                    "--cpu", str(args.client_cpu))  # fmt: skip
    spy = _py_spy(pids["gateway"], args)
    loaded = json.loads(client.communicate()[0])
    probed = json.loads(probe.communicate()[0])
    cpu = {name: round(cpu_seconds(pid) - before[name], 2) for name, pid in pids.items()}
    cpu.update(load_client=loaded.pop("cpu_s"), probe=probed.pop("cpu_s"))
    probed.pop("pinned_cpus")
    if spy is not None:
        spy.wait()
    return {**loaded, **probed, "cpu_s": cpu}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-load-"))
    port = _free_port()
    settings = StackSettings(
        worker="sim", sim_config=SimConfig(device="h200", model="llama-3-8b"),
        frontend_address=f"ipc://{log_dir}/frontend.sock", log_dir=log_dir,
        gateway_config=GatewayConfig(http_port=port, max_requests_per_client=args.capacity),
        scheduler_config=SchedulerConfig(max_num_seqs=args.capacity),
    )  # fmt: skip
    with LocalStack(settings) as stack:
        res = run(port, stack.pids(), args)
    report: dict[str, Any] = {
        "connections": args.connections, "duration_s": args.duration, "capacity": args.capacity,
        "backoff_s": args.backoff, "admitted": res["admitted"], "completed": res["completed"],
        "failed": res["failed"], "failures": res["failures"], "refused": res["refused"],
        "refusal_latency": _quantiles(res["refusal_s"]), "health": _quantiles(res["health_s"]),
        "health_over_limit": sum(s > args.health_within for s in res["health_s"]),
        "health_bad": res["health_bad"][:20], "cpu_s": res["cpu_s"],
        "load_client_pinned": res["pinned_cpus"], "log_dir": str(log_dir),
    }  # fmt: skip
    (args.out / "gateway-load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if args.py_spy is not None and (args.py_spy / "gateway.txt").exists():
        print("gateway, CPU by function (own samples):")
        print("\n".join(top_self(args.py_spy / "gateway.txt")))
    ok = (not res["failed"] and not res["health_bad"] and not report["health_over_limit"]
          and res["refused"] and res["completed"])  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
