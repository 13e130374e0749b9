"""Disaggregated prefill and decode on this CPU: what a KV hand-over costs next to the prefill
it saves (docs/design/disaggregation.md).

    PYTHONPATH=. .venv/bin/python bench/disagg_bench.py --input-lens 128,512,1024 --repeats 3

One prefill engine and one decode engine (SmolLM2-135M, fp32), first with the KV over ipc,
then over tcp loopback (what separate hosts would use), each a fresh stack. Requests run one
at a time (distinct random prompts: no prefix-cache hit), 4 tokens each. Per prompt length,
the medians of, from the services' own logs:

* prefill_s: the prefill engine's forward time for the prompt (its steps' forward_s);
* handover_s: from the prefill scheduler's final output (finish "handover") to the decode
  scheduler's HandoverDone (the KV is in its pool): the frontend's hop, the pull, both
  schedulers' handling;
* pull_s, MB, GB/s: the decode worker's pull alone (request, gather, transfer, scatter);
* ratio: handover_s / prefill_s (the issue's goal: <= 10%).

`--breakdown` (in this process, no stack): where a pull's time goes for `--breakdown-len`
tokens of SmolLM2's KV (30 layers, 3 KV heads of 64, fp32, blocks of 16): the gather into one
buffer, the send and receive of that frame over ipc and tcp loopback, the scatter into blocks.

Run it alone (`flock -x`): timings on a shared machine swing. Writes <out>/disagg_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.server_config import ServerConfig
from services.worker.config import WorkerConfig
from shared.client import Client

VOCAB = 49152  # SmolLM2's: random prompts stay in it


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-lens", default="128,512,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="ipc,tcp")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--breakdown", action="store_true", help="only the pull's parts, in process")
    p.add_argument("--breakdown-len", type=int, default=1024)
    return p.parse_args(argv)


def records(log_dir: Path, service: str) -> list[dict[str, Any]]:
    lines = (log_dir / f"{service}.log").read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def run_stack(transport: str, lens: list[int], repeats: int) -> list[tuple[int, str]]:
    """Every prompt once, one at a time, on a fresh P=1 D=1 stack; (length, rid) of each."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"disagg-{transport}-"))
    settings = StackSettings(
        worker_config=WorkerConfig(dtype="float32", quantization="none",
                                   kv_cache_memory=384 << 20, max_model_len=2048),
        gateway=False, log_dir=log_dir, prefill_engines=1, decode_engines=1,
        kv_transport=transport, server_config=ServerConfig(summary_interval_s=0.0),
    )  # fmt: skip
    rng = random.Random(0)
    stack = LocalStack(settings).start()
    try:
        stack.wait_ready(timeout=600)
        with Client(stack.frontend_address, timeout=300) as client:
            client.generate(prompt_token_ids=[rng.randrange(VOCAB) for _ in range(64)],
                            max_tokens=4, temperature=0.0)  # warm-up  # fmt: skip
            for n in lens:
                for i in range(repeats):
                    ids = [rng.randrange(VOCAB) for _ in range(n)]
                    client.generate(prompt_token_ids=ids, max_tokens=4, temperature=0.0,
                                    ignore_eos=True, request_id=f"{n}-{i}")  # fmt: skip
    finally:
        stack.stop()
    return measure(log_dir, lens, repeats)


def measure(log_dir: Path, lens: list[int], repeats: int) -> list[tuple[int, str]]:
    received = {r["client_id"]: r["rid"] for r in records(log_dir, "tokenizer")
                if r.get("event") == "request_received"}  # fmt: skip
    prefill = records(log_dir, "scheduler-0")
    decode = {r["rid"]: r for r in records(log_dir, "scheduler-1")
              if r.get("event") == "handover_done"}  # fmt: skip
    admitted = {r["rid"]: epoch(r["ts"]) for r in prefill if r.get("event") == "request_admitted"}
    finished = {r["rid"]: epoch(r["ts"]) for r in prefill
                if r.get("event") == "request_finished"}  # fmt: skip
    steps = [r for r in prefill if r.get("event") == "step"]
    rows = []
    for n in lens:
        for i in range(repeats):
            rid = received[f"{n}-{i}"]
            start, end = admitted[rid], finished[rid]
            forward = sum(s["forward_s"] for s in steps if start <= s["t_plan"] <= end)
            done = decode[f"{rid}.1"]
            assert done["ok"], done
            rows.append(dict(input_len=n, prefill_s=forward,
                             handover_s=epoch(done["ts"]) - end, pull_s=done["seconds"],
                             num_bytes=done["num_bytes"]))  # fmt: skip
    return rows  # type: ignore[return-value]


def summarize(rows: list[dict[str, Any]], transport: str) -> list[dict[str, Any]]:
    out = []
    for n in sorted({r["input_len"] for r in rows}):
        mine = [r for r in rows if r["input_len"] == n]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("prefill_s", "handover_s", "pull_s", "num_bytes")}  # fmt: skip
        out.append(dict(transport=transport, input_len=n, **med,
                        gb_per_s=med["num_bytes"] / med["pull_s"] / 1e9,
                        ratio=med["handover_s"] / med["prefill_s"]))  # fmt: skip
    return out


def breakdown(num_tokens: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of each part of one pull of `num_tokens` tokens' blocks."""
    import time

    import torch
    import zmq

    from services.worker.kv_cache import KVCache
    from services.worker.weights import ModelArgs

    args = ModelArgs("llama", VOCAB, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5, 2048, True, False)
    num = num_tokens // 16
    src, dst = (KVCache(args, 4 * num, 16, "float32", "cpu") for _ in range(2))
    blocks = list(range(num, 2 * num))
    out: dict[str, list[float]] = {"gather": [], "scatter": [], "ipc": [], "tcp": []}
    ctx = zmq.Context.instance()
    for name, addr in (
        ("ipc", f"ipc://{tempfile.mkdtemp()}/kv.sock"),
        ("tcp", "tcp://127.0.0.1:0"),
    ):
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind(addr)
        dealer.connect(router.getsockopt(zmq.LAST_ENDPOINT).decode())
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = src.gather(blocks)
            t1 = time.perf_counter()
            dealer.send(b"read")
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, data.reshape(-1).view(torch.uint8).numpy()], copy=False)
            frame = dealer.recv(copy=False)
            t2 = time.perf_counter()
            got = torch.frombuffer(frame.buffer, dtype=torch.float32).view(data.shape)
            dst.scatter(blocks, got)
            t3 = time.perf_counter()
            out["gather"].append(t1 - t0)
            out[name].append(t2 - t1)
            out["scatter"].append(t3 - t2)
        router.close()
        dealer.close()
    return {k: statistics.median(v) for k, v in out.items()} | {"bytes": float(data.numel() * 4)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.breakdown:
        parts = breakdown(args.breakdown_len)
        print(f"{args.breakdown_len} tokens, {parts['bytes'] / 1e6:.1f} MB: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms ({parts['bytes'] / v / 1e9:.2f} GB/s)"
            for k, v in parts.items() if k != "bytes"))  # fmt: skip
        return 0
    lens = [int(x) for x in args.input_lens.split(",")]
    table = []
    for transport in args.transports.split(","):
        table += summarize(run_stack(transport, lens, args.repeats), transport)  # type: ignore[arg-type]
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               "?")  # fmt: skip
    print(f"CPU: {cpu}")
    print("transport  input  prefill_s  handover_s  ratio   pull_s     MB    GB/s")
    for r in table:
        print(f"{r['transport']:9} {r['input_len']:6} {r['prefill_s']:10.3f} "
              f"{r['handover_s']:11.4f} {r['ratio']:6.1%} {r['pull_s']:8.4f} "
              f"{r['num_bytes'] / 1e6:6.1f} {r['gb_per_s']:7.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "disagg_cpu.json").write_text(json.dumps(dict(cpu=cpu, rows=table), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
