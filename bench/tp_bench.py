"""Tensor-parallel step time on this machine: the same workload at each world size.

    .venv/bin/python bench/tp_bench.py --world-sizes 1,3

For each N it starts N worker ranks (`python bench/tp_bench.py --rank R ...`, gloo over
loopback, each a ModelRunner on SmolLM2-135M in fp32) and runs on every rank: one prefill step
of `--batch` prompts of `--prompt-len` tokens, then `--decode-steps` decode steps of the whole
batch (greedy; the sampled tokens feed the next plan, as the scheduler would). Rank 0 reports the
median decode step, the prefill step, decode tokens/s, and the all-reduces one step makes
(counted on the group, with their bytes). Prints one JSON line per N and a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


def _plans(batch: int, prompt_len: int, decode_steps: int, block_size: int) -> Any:
    from services.worker.plan_writer import PlanWriter
    from shared.protocol.sampling import SamplingParams
    from shared.protocol.worker_channel import StepPlan

    greedy = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    per_seq = -(-(prompt_len + decode_steps) // block_size)  # blocks: prompt + decodes fit
    writer = PlanWriter()
    seqs = [
        writer.new_sequence(f"s{i}", [(7 * i + j) % 30000 + 100 for j in range(prompt_len)],
                            prompt_len, list(range(i * per_seq, (i + 1) * per_seq)), greedy)
        for i in range(batch)
    ]  # fmt: skip
    prefill = writer.plan({s.rid: prompt_len for s in seqs}, seqs)

    def decode() -> StepPlan:
        """The next steady decode step: every sequence computes the token it sampled last."""
        return writer.plan({s.rid: 1 for s in seqs})

    return prefill, decode


def run_rank(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    import torch

    from services.worker.config import ParallelConfig, WorkerConfig
    from services.worker.runner import ModelRunner

    config = WorkerConfig(dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)
    parallel = ParallelConfig(args.rank, args.world_size, args.dist_init, 30.0)
    runner = ModelRunner(config, parallel=parallel)
    calls = {"n": 0, "bytes": 0}
    reduce = runner.group.all_reduce

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        calls["bytes"] += x.numel() * x.element_size()
        return reduce(x)

    runner.model.group.all_reduce = counting  # type: ignore[method-assign]
    prefill, decode = _plans(args.batch, args.prompt_len, args.decode_steps, config.block_size)
    start = time.perf_counter()
    runner.execute(prefill)
    prefill_s = time.perf_counter() - start
    times = []
    for _ in range(args.decode_steps):
        calls.update(n=0, bytes=0)
        plan = decode()
        start = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - start)
    if args.rank != 0:
        return None
    median = statistics.median(times)
    return {
        "world_size": args.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "prefill_step_s": round(prefill_s, 4),
        "decode_step_median_s": round(median, 4),
        "decode_tok_s": round(args.batch / median, 1),
        # one rank has no group: its all_reduce is the identity, nothing crosses a link
        "allreduces_per_decode_step": calls["n"] if args.world_size > 1 else 0,
        "allreduce_bytes_per_decode_step": calls["bytes"] if args.world_size > 1 else 0,
        "weight_bytes_rank0": runner.model.weight_bytes(),
    }


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--world-size",
                    str(world),
                    "--dist-init",
                    f"tcp://127.0.0.1:{port}",
                    "--batch",
                    str(args.batch),
                    "--prompt-len",
                    str(args.prompt_len),
                    "--decode-steps",
                    str(args.decode_steps),
                    "--out",
                    str(out),
                ],
                cwd=ROOT,
            )  # fmt: skip
            for r in range(world)
        ]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"a rank of world size {world} failed")
        return json.loads(out.read_text())


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="1,3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dist-init", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        row = run_rank(args)
        if row is not None:
            args.out.write_text(json.dumps(row))
        return 0
    print(f"# {platform.processor() or platform.machine()}, SmolLM2-135M fp32", flush=True)
    rows = [run_world(int(n), args) for n in args.world_sizes.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    base = rows[0]["decode_step_median_s"]
    for row in rows:
        print(f"N={row['world_size']}: decode step {row['decode_step_median_s'] * 1e3:.1f} ms "
              f"({row['decode_step_median_s'] / base:.2f}x N={rows[0]['world_size']}), "
              f"{row['decode_tok_s']} tok/s, prefill step {row['prefill_step_s'] * 1e3:.0f} ms, "
              f"{row['allreduces_per_decode_step']} all-reduces "
              f"({row['allreduce_bytes_per_decode_step']} B) per decode step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
