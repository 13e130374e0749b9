"""Data parallelism end to end: engines behind one frontend, measured side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/dp_bench.py scaling --engines 1,2,4       # SIMULATED H200
    PYTHONPATH=. .venv/bin/python bench/dp_bench.py routing                       # SIMULATED H200
    PYTHONPATH=. .venv/bin/python bench/dp_bench.py scaling --worker model --engines 1,2 \\
        --num-prompts 16 --input-len 64 --output-len 32                          # this CPU

* `scaling`: the same burst (`--num-prompts` random prompts of `--input-len` tokens,
  `--output-len` out, EOS ignored, all at once) on 1, 2, 4 engines (`--engines`); output
  throughput and TTFT per engine count, and the ratio to one engine.
* `routing`: `--num-systems` distinct long system prompts (`--system-len` tokens) x
  `--per-system` requests (a distinct `--input-len`-token question each) in a random order,
  arriving at `--request-rate` per second (Poisson; 0: all at once), on `--routing-engines`
  engines with `--router-policy cache-aware` and then `least-load`:
  mean / p90 TTFT, throughput and the prefill tokens the engines computed (their
  `num_prefill_tokens`, summed): the cache-aware router should need far fewer.

Each configuration gets a fresh stack (cold prefix caches). Run it alone on the machine
(end-to-end timings on a shared machine swing).
Writes <out>/dp_<mode>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import ConveyorBackend, SamplingChoice
from conveyor.bench.metrics import compute_metrics
from conveyor.bench.runner import run_workload
from conveyor.bench.workloads import BenchRequest, WorkloadConfig, generate
from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.scheduler.server_config import ServerConfig
from services.tokenizer.config import FrontendConfig
from services.tokenizer.router import RouterConfig
from services.worker.config import WorkerConfig
from services.worker.sim.config import SimConfig
from shared.client import Client
from shared.config_flags import parse_size


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("scaling", "routing"))
    p.add_argument("--worker", choices=("model", "sim"), default="sim")
    p.add_argument("--sim-device", default="h200")
    p.add_argument("--sim-model", default="llama-3-8b")
    p.add_argument("--dtype", default="float32", help="real worker dtype")
    p.add_argument("--kv-cache-memory", default="512MiB", help="real worker KV cache, each")
    p.add_argument("--engines", default="1,2,4", help="scaling: engine counts to compare")
    p.add_argument("--routing-engines", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-systems", type=int, default=8)
    p.add_argument("--per-system", type=int, default=32)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--request-rate", type=float, default=32.0, help="routing: requests/s")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results/dp"))
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stack(args: argparse.Namespace, num_engines: int, policy: str) -> LocalStack:
    worker = WorkerConfig(dtype=args.dtype, kv_cache_memory=parse_size(args.kv_cache_memory))
    return LocalStack(
        StackSettings(
            worker=args.worker,
            sim_config=SimConfig(device=args.sim_device, model=args.sim_model),
            frontend_address=f"tcp://127.0.0.1:{_free_port()}",
            scheduler_config=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            server_config=ServerConfig(summary_interval_s=0.0),
            worker_config=worker,
            frontend_config=FrontendConfig(router=RouterConfig(policy=policy)),
            gateway=False,
            log_dir=Path(tempfile.mkdtemp(prefix=f"dp-{num_engines}-{policy}-")),
            data_parallel_size=num_engines,
        )
    )


def _routing_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """Every system prompt's requests in a random order (seeded), as a mixed stream of users
    arrives: no fixed pattern that a load-only router would map to engines by chance."""
    rng = random.Random(0)
    systems = [[rng.randrange(1000, 40000) for _ in range(args.system_len)]
               for _ in range(args.num_systems)]  # fmt: skip
    order = [s for s in range(args.num_systems) for _ in range(args.per_system)]
    rng.shuffle(order)
    out = []
    for s in order:
        question = [rng.randrange(1000, 40000) for _ in range(args.input_len)]
        out.append(BenchRequest(len(out), systems[s] + question, args.output_len))
    return out


def _run(stack: LocalStack, requests: list[BenchRequest], rate: float) -> dict[str, Any]:
    """One measured burst on a ready stack; metrics plus the engines' prefill tokens."""
    address = stack.frontend_address
    sampling = SamplingChoice(temperature=0.0, ignore_eos=True)

    async def go() -> Any:
        backend = ConveyorBackend(address, id_prefix=f"dp-{uuid.uuid4().hex[:8]}")
        try:
            arrivals = ArrivalConfig(request_rate=rate or math.inf)
            return await run_workload(backend, requests, arrivals, sampling, None)
        finally:
            await backend.aclose()

    outcome = asyncio.run(go())
    metrics = compute_metrics(outcome.traces, outcome.duration_s)
    with Client(address, timeout=60.0) as client:
        stats = client.stats()
    engines = stats.get("engines") or {"0": stats["engine"]}
    metrics["prefill_tokens"] = sum(e["num_prefill_tokens"] for e in engines.values() if e)
    metrics["admitted_per_engine"] = {k: e["num_admitted"] for k, e in engines.items() if e}
    return metrics


def _measure(args: argparse.Namespace, num_engines: int, policy: str,
             requests: list[BenchRequest], rate: float = 0.0) -> dict[str, Any]:  # fmt: skip
    stack = _stack(args, num_engines, policy)
    stack.start()
    try:
        stack.wait_ready(timeout=900.0)
        with Client(stack.frontend_address, timeout=600.0) as client:  # first-use costs
            client.generate(prompt_token_ids=[101 + i for i in range(24)], max_tokens=2)
        m = _run(stack, requests, rate)
    finally:
        stack.stop()
    if m["failed"]:
        raise SystemExit(f"{num_engines} engines, {policy}: {m['failed']} requests failed")
    print(
        f"{num_engines} engine(s) {policy:11s}: output {m['output_throughput']:9.1f} tok/s, "
        f"mean TTFT {m['mean_ttft_ms']:8.1f} ms, p90 TTFT {m['p90_ttft_ms']:8.1f} ms, "
        f"prefill tokens {m['prefill_tokens']:.0f}, per engine {m['admitted_per_engine']}",
        flush=True,
    )
    return m


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    if args.mode == "scaling":
        workload = WorkloadConfig(name="uniform", num_prompts=args.num_prompts,
                                  input_len=args.input_len, output_len=args.output_len)  # fmt: skip
        requests = generate(workload)
        for n in [int(x) for x in args.engines.split(",")]:
            results[str(n)] = _measure(args, n, "least-load", requests)
        base = results[args.engines.split(",")[0]]
        for n, m in results.items():
            x = m["output_throughput"] / base["output_throughput"]
            print(f"{n} engine(s): throughput {x:.2f}x the first", flush=True)
    else:
        requests = _routing_workload(args)
        for policy in ("cache-aware", "least-load"):
            results[policy] = _measure(args, args.routing_engines, policy, requests,
                                       args.request_rate)  # fmt: skip
        ca, ll = results["cache-aware"], results["least-load"]
        prefill_x = ca["prefill_tokens"] / ll["prefill_tokens"]
        print(
            f"cache-aware vs least-load: prefill tokens {prefill_x:.2f}x, "
            f"mean TTFT {ca['mean_ttft_ms'] / ll['mean_ttft_ms']:.2f}x, "
            f"throughput {ca['output_throughput'] / ll['output_throughput']:.2f}x",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"dp_{args.mode}.json"
    keep = ("duration", "completed", "failed", "output_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "prefill_tokens",
            "admitted_per_engine")  # fmt: skip
    slim = {k: {f: m.get(f) for f in keep} for k, m in results.items()}
    meta = {k: str(v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"args": meta, "results": slim}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
