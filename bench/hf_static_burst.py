"""transformers' static `generate()` on the CPU burst: the peer figure beside Conveyor's.

The very requests `conveyor bench --compare-batching --scenarios mixed --num-prompts N --scale S
--seed 0` sends (same token ids and output lengths, EOS ignored) go to
`LlamaForCausalLM.generate()` in static batches of `--batch-size`, in arrival order: each batch
left-padded to its longest prompt and generating its longest output (bench/gpu/e2e_hf.py's
`static_burst`). Only the tokens each request asked for count. TTFT of a request is bounded
below by its batch's start (every earlier batch ran first); the p50 of that bound is printed.
Run it alone on the machine:

    PYTHONPATH=. .venv/bin/python bench/hf_static_burst.py \\
        --num-prompts 64 --scale 1 --batch-size 32 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.e2e_hf import DTYPES, static_burst
from conveyor.bench.workloads import WorkloadConfig, generate
from shared.model_files import prepare_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/hf_static_burst.json"))
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    # the model folder the worker converted (same weights as the engine's)
    folder = prepare_model(None)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).eval()
    model.generation_config.eos_token_id = None
    requests = generate(
        WorkloadConfig("mixed", num_prompts=args.num_prompts, seed=args.seed, scale=args.scale)
    )
    batches = [requests[i : i + args.batch_size] for i in range(0, len(requests), args.batch_size)]
    ttft_floor: list[float] = []
    rows = []
    with torch.inference_mode():
        static_burst(model, requests[:2], "cpu")  # warm-up
        start = time.perf_counter()
        for batch in batches:
            ttft_floor += [time.perf_counter() - start] * len(batch)
            rows.append(static_burst(model, batch, "cpu"))
        seconds = time.perf_counter() - start
    tokens = sum(r.max_tokens for r in requests)
    report = {
        "engine": f"transformers generate(), static batches of {args.batch_size}",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_throughput": tokens / seconds,
        "ttft_p50_lower_bound_s": statistics.median(ttft_floor),
        "batches": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"transformers static B={args.batch_size} ({args.dtype}): {len(requests)} requests, "
        f"{tokens} output tokens in {seconds:.1f} s = {tokens / seconds:.1f} out tok/s; "
        f"TTFT p50 >= {report['ttft_p50_lower_bound_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
