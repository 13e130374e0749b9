"""The side-by-side reference: the same burst through transformers' own static `generate()`.

For each burst size N, the very requests `conveyor bench --workload W --num-prompts N --seed S
--scale X` sends (same token ids, same output lengths) go to `LlamaForCausalLM.generate()` as
ONE static batch on the device: prompts left-padded to the longest, every row generating the
longest output (end-of-sequence ignored, as the engine's burst ignores it). Only the tokens each
request asked for count as output, so the padding work static batching does is its cost, as it
is in the engine's own static mode. Timed with the device synchronized, after one small warm-up
generate. Every `--run` (one per model) in one process: transformers is imported once. Writes
`--json` with `ok` and, per model and burst: output tok/s, seconds, the batch shape.
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
        ids,
        attention_mask=mask,
        max_new_tokens=longest_output,
        min_new_tokens=longest_output,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
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
    p.add_argument(
        "--run",
        nargs=4,
        action="append",
        required=True,
        metavar=("NAME", "FOLDER", "BURSTS", "SCALE"),
        help="one model: its name, folder, burst sizes (64,256) and length scale",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def run_model(args: argparse.Namespace, folder: Path, bursts: str, scale: float) -> dict:
    """Every burst of one model; a burst that fails (out of memory, say) is recorded as such."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype])
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None
    vocab = min(json.loads((folder / "config.json").read_text())["vocab_size"], 49152)
    warm = WorkloadConfig(
        args.workload, num_prompts=2, seed=args.seed + 1, scale=0.05, vocab_size=vocab
    )
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        static_burst(model, generate(warm), args.device)
        for size in (int(v) for v in bursts.split(",")):
            cfg = WorkloadConfig(args.workload, num_prompts=size, seed=args.seed, scale=scale)
            try:
                row = {"burst": size, "ok": True, **static_burst(model, generate(cfg), args.device)}
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
                row = {"burst": size, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            if args.device.startswith("cuda"):
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.empty_cache()
            rows.append(row)
            print(f"gpu_e2e_hf: {folder.name}: {row}", flush=True)
    return {"folder": str(folder), "ok": all(r["ok"] for r in rows), "bursts": rows}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    models = {
        name: run_model(args, Path(folder), bursts, float(scale))
        for name, folder, bursts, scale in args.run
    }
    report = {
        "ok": all(m["ok"] for m in models.values()),
        "dtype": args.dtype,
        "device": args.device,
        "models": models,
    }
    args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
