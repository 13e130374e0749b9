"""The side-by-side reference: the same burst through transformers' own static `generate()`.

For each burst size N, the very requests `conveyor bench --workload W --num-prompts N --seed S
--scale X` sends (same token ids, same output lengths) go to `LlamaForCausalLM.generate()` as
ONE static batch on the device: prompts left-padded to the longest, every row generating the
longest output (end-of-sequence ignored, as the engine's burst ignores it). Only the tokens each
request asked for count as output, so the padding work static batching does is its cost, as it
is in the engine's own static mode. Timed with the device synchronized, after one small warm-up
generate. Writes `--json` with `ok` and, per burst: output tok/s, seconds, the batch shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from conveyor.bench.workloads import WorkloadConfig, generate

PAD_ID = 2  # SmolLM2's <|im_end|>; prompts never hold it (ids start at 100)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def static_burst(model: Any, requests: list, device: str) -> dict[str, Any]:
    """One generate() over every request; returns the timing and the counts."""
    longest_prompt = max(r.prompt_len for r in requests)
    longest_output = max(r.max_tokens for r in requests)
    ids = torch.full((len(requests), longest_prompt), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(requests):  # left padding: every row's last prompt token aligned
        ids[row, longest_prompt - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[row, longest_prompt - r.prompt_len :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=longest_output, min_new_tokens=longest_output,
        do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
    )  # fmt: skip
    sync(device)
    seconds = time.perf_counter() - start
    useful = sum(r.max_tokens for r in requests)
    generated = int(out.shape[1] - longest_prompt)
    return {
        "num_requests": len(requests),
        "seconds": seconds,
        "output_throughput": useful / seconds,  # tokens the requests asked for, per second
        "generated_throughput": len(requests) * generated / seconds,  # padding rows included
        "total_output_tokens": useful,
        "padded_prompt_len": longest_prompt,
        "max_new_tokens": generated,
    }


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--bursts", default="64,256", help="burst sizes (requests sent at once)")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype])
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    bursts: list[dict[str, Any]] = []
    report: dict[str, Any] = {"ok": False, "model": str(args.model), "dtype": args.dtype,
                              "device": args.device, "bursts": bursts}  # fmt: skip
    with torch.inference_mode():
        warm = generate(WorkloadConfig(name=args.workload, num_prompts=2, seed=args.seed + 1,
                                       scale=0.05, vocab_size=min(vocab, 49152)))  # fmt: skip
        static_burst(model, warm, args.device)
        for size in (int(v) for v in args.bursts.split(",")):
            cfg = WorkloadConfig(name=args.workload, num_prompts=size, seed=args.seed,
                                 scale=args.scale)  # fmt: skip
            result = {"burst": size, **static_burst(model, generate(cfg), args.device)}
            if args.device.startswith("cuda"):
                result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            bursts.append(result)
            print(f"gpu_e2e_hf: {result}", flush=True)
    report["ok"] = True
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
