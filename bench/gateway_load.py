"""Load on the HTTP gateway (docs/RELIABILITY.md §8): `--connections` concurrent HTTP
connections, each sending completions back to back for `--duration` seconds, against one
engine whose capacity is below that (the gateway admits `--capacity` engine requests per
client, as `--max-requests-per-client`; every connection here is the same client address),
while a probe asks `/health` every `--probe-every` s on its own connection.

    PYTHONPATH=. .venv/bin/python bench/gateway_load.py --connections 1000 --duration 60

The engine: LocalStack with the SIMULATED worker (H200 step times: what is measured is the
gateway and the frontend, on this machine's CPU, not the model). The load client is an asyncio
HTTP client (httpx) with one connection per simulated user. Passes when:

* every `/health` answers 200 within `--health-within` s (1 s);
* every request past capacity gets 429 or 503 quickly (its latency is reported: median, p99,
  max), never a time-out;
* every admitted request (200) completes with its `max_tokens` tokens: none fails.

Writes <out>/gateway-load.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from conveyor.launcher import LocalStack, StackSettings
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--capacity", type=int, default=256, help="engine requests admitted at once")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probe-every", type=float, default=0.1)
    p.add_argument("--health-within", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path("results/gateway-load"))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tally:
    def __init__(self) -> None:
        self.admitted = 0
        self.completed = 0
        self.failed: list[str] = []
        self.refused: dict[int, int] = {}
        self.refusal_s: list[float] = []
        self.health_s: list[float] = []
        self.health_bad: list[str] = []


async def user(url: str, n: int, end: float, args: argparse.Namespace, tally: Tally) -> None:
    """One connection: completions back to back until `end`."""
    body = {"prompt": f"user {n} asks", "max_tokens": args.max_tokens, "temperature": 0}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                r = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                tally.failed.append(f"{type(exc).__name__}")
                continue
            if r.status_code in (429, 503):
                tally.refused[r.status_code] = tally.refused.get(r.status_code, 0) + 1
                tally.refusal_s.append(time.monotonic() - started)
                await asyncio.sleep(0.2)  # a client backs off a little before trying again
                continue
            tally.admitted += 1
            usage = r.json().get("usage", {}) if r.status_code == 200 else {}
            if usage.get("completion_tokens") == args.max_tokens:
                tally.completed += 1
            else:
                tally.failed.append(f"http_{r.status_code}: {r.text[:200]}")


async def probe(url: str, end: float, args: argparse.Namespace, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError as exc:
                status = 0
                tally.health_bad.append(type(exc).__name__)
            took = time.monotonic() - started
            tally.health_s.append(took)
            if status != 200 or took > args.health_within:
                tally.health_bad.append(f"{status} in {took:.3f} s")
            await asyncio.sleep(args.probe_every)


async def run(url: str, args: argparse.Namespace) -> Tally:
    tally = Tally()
    end = time.monotonic() + args.duration
    users = [user(url, n, end, args, tally) for n in range(args.connections)]
    await asyncio.gather(probe(url, end, args, tally), *users)
    return tally


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"median_s": round(statistics.median(ordered), 4), "p99_s": round(p99, 4),
            "max_s": round(ordered[-1], 4), "n": len(ordered)}  # fmt: skip


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
    with LocalStack(settings):
        tally = asyncio.run(run(f"http://127.0.0.1:{port}", args))
    report: dict[str, Any] = {
        "connections": args.connections, "duration_s": args.duration,
        "capacity": args.capacity, "admitted": tally.admitted, "completed": tally.completed,
        "failed": len(tally.failed), "failures": tally.failed[:20], "refused": tally.refused,
        "refusal_latency": _quantiles(tally.refusal_s), "health": _quantiles(tally.health_s),
        "health_bad": tally.health_bad[:20], "log_dir": str(log_dir),
    }  # fmt: skip
    (args.out / "gateway-load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = not tally.failed and not tally.health_bad and tally.refused and tally.completed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
