"""The linear-layer floor of a `conveyor bench` workload on this machine, and a run against it.

Floor = the workload's linear-layer FLOPs at the GEMM rates this machine reaches on the model's
own shapes: prompt tokens in 512-row blocks (prefill), output tokens in `--decode-rows`-row blocks
(decode), the LM head once per output token. Rates are measured here, in float32 and bfloat16,
and the floor uses the faster one (what the issue's goal is stated against). Attention, norms and
everything else are left out, so no engine can beat the floor; `--result` (a `conveyor bench`
JSON) prints that run's output tok/s against the floor's.

    PYTHONPATH=. python bench/roofline.py [--workload mixed --num-prompts 64 --seed 0]
        [--result results/run/bench.json ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from conveyor.bench.workloads import WorkloadConfig, generate
from services.worker.dtype_probe import linear_shapes
from services.worker.weights import model_args
from shared.model_files import prepare_model


def gemm_gflops(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype) -> float:
    """Best-of-3 GFLOP/s of F.linear over `shapes` at `rows` rows."""
    gen = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))
        for k, n in shapes
    ]
    flops = sum(2.0 * rows * k * n for k, n in shapes)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(4):  # the first is a warm-up
            start = time.perf_counter()
            for x, w in pairs:
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument(
        "--result", type=Path, nargs="*", default=[], help="conveyor bench JSONs to rate"
    )
    args = ap.parse_args()
    margs = model_args(prepare_model(None))
    reqs = generate(
        WorkloadConfig(
            name=args.workload, num_prompts=args.num_prompts, seed=args.seed, scale=args.scale
        )
    )
    prompt_tokens = sum(r.prompt_len for r in reqs)
    output_tokens = sum(r.max_tokens for r in reqs)
    layer = linear_shapes(margs)
    head = [(margs.hidden_size, margs.vocab_size)]
    per_token = margs.num_layers * sum(2.0 * k * n for k, n in layer)
    head_flops = 2.0 * margs.hidden_size * margs.vocab_size
    floors = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        prefill = gemm_gflops(layer, 512, dtype)
        decode = gemm_gflops(layer, args.decode_rows, dtype)
        lm = gemm_gflops(head, args.decode_rows, dtype)
        seconds = (
            prompt_tokens * per_token / prefill / 1e9
            + output_tokens * per_token / decode / 1e9
            + output_tokens * head_flops / lm / 1e9
        )
        floors[name] = seconds
        print(
            f"{name}: GEMM {prefill:.1f} GFLOP/s (512 rows), {decode:.1f} "
            f"({args.decode_rows} rows), LM head {lm:.1f}; floor {seconds:.1f} s = "
            f"{output_tokens / seconds:.0f} output tok/s"
        )
    best = min(floors, key=floors.get)
    floor_tps = output_tokens / floors[best]
    print(
        f"workload {args.workload} x{args.num_prompts}: {prompt_tokens} prompt + {output_tokens} "
        f"output tokens; roofline (faster dtype, {best}): {floor_tps:.0f} output tok/s"
    )
    for result in args.result:
        data = json.loads(result.read_text())
        # a plain `conveyor bench` result, or --compare-batching's compare.json (runs by mode)
        runs = {"run": data} if "runs" not in data else {
            f"{scenario}/{mode}": run
            for scenario, modes in data["runs"].items()
            for mode, run in modes.items()
        }  # fmt: skip
        for name, run in runs.items():
            tps = float(run["output_throughput"])
            print(
                f"{result}: {name}: {tps:.1f} output tok/s = {tps / floor_tps:.0%} of the roofline"
            )


if __name__ == "__main__":
    main()
