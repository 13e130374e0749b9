"""Correctness of the engine's forward on the device, on random-weight model folders.

Three checks, each on the same random prompts (ids above the special tokens):

1. **fp32 greedy = transformers**: the worker (TritonOps on CUDA) generates greedily through
   mixed, chunked steps (`PlanDriver`: 16-token prefill chunks beside running decodes, block
   tables shuffled) and must produce transformers' fp32 greedy `generate()` tokens. A prompt
   may diverge only at a near-tie: where transformers' own logits put the two candidates within
   `NEAR_TIE_FP32` (random weights make such ties rare but possible; a real bug moves logits by
   O(1)). TF32 is off for both.
2. **bf16 tolerance**: the prompts' last-position logits from the worker in bfloat16 against
   transformers in fp32, as max |diff| over the RMS of the fp32 logits. The bound is relative to
   transformers' own bf16 error on the same prompts (`BF16_ERROR_RATIO` x it, plus a floor):
   what bf16 costs anyway, measured beside it, not a constant from another machine.
3. **Triton = torch on the same plans**: two workers, one per attention backend, execute the very
   same plans (chunked prefill beside decodes; greedy tokens from the Triton side feed both). In
   fp32 their logits agree within `TRITON_TORCH_RTOL_FP32` x the logits' RMS; in bf16 a third,
   fp32 torch worker runs the plans too, and Triton's bf16 error against it may be at most
   `BF16_ERROR_RATIO` x torch's own bf16 error (or the floor).

`--model` gets all three; each `--extra-model` gets check 3 in bfloat16 (the 1B shape's
GQA group of 4). Writes `--json` with `ok`. On CPU (dry run) the Triton side runs under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from services.worker.config import WorkerConfig
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult
from tests.support.plan_driver import PlanDriver

NEAR_TIE_FP32 = 1e-3  # fp32 reassociation moves logits ~1e-5; a broken kernel moves them ~1
# The worker's bf16 error may be 3x transformers' own (or torch's own) bf16 error, or 2% of the
# logits' RMS, whichever is larger. Measured on CPU: the worker 0.045 against transformers'
# 0.036; Triton under the interpreter (which rounds by truncation) 1.2-1.7x torch's. A wrong mask,
# rotation or block table moves the logits by about their RMS: 10x past the bound.
BF16_ERROR_RATIO = 3.0
BF16_ERROR_FLOOR = 0.02
TRITON_TORCH_RTOL_FP32 = 1e-3  # x RMS of the logits (fp32 reassociation over 30 layers)
FIRST_PLAIN_ID = 100  # prompts avoid the tokenizer's special ids
CHUNK = 16
BLOCK_SIZE = 16


def make_runner(folder: Path, device: str, dtype: str, backend: str, max_len: int) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(folder),
            dtype=dtype,
            device=device,
            block_size=BLOCK_SIZE,
            kv_cache_memory=128 << 20,
            max_model_len=max_len,
            attention_backend=backend,
        )
    )


def random_prompts(num: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list:
    rng = random.Random(seed)
    top = min(vocab_size, 49152)
    return [
        [rng.randrange(FIRST_PLAIN_ID, top) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def staggered_run(driver: PlanDriver, prompts: list[list[int]], new_tokens: int) -> dict:
    """Admit one prompt every other step, so prefill chunks share steps with decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rids = [f"p{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts, strict=True):
        driver.add(rid, ids, params)
    admitted: list[str] = []
    while driver.active():
        live = [r for r in admitted if not driver.seqs[r].done]
        if len(admitted) < len(rids) and (driver.step_id % 2 == 0 or not live):
            admitted.append(rids[len(admitted)])
            live.append(admitted[-1])
        driver.step(live)
    return {rid: driver.seqs[rid].outputs for rid in rids}


# ---- 1. fp32 greedy against transformers ------------------------------------------------------


def hf_model(folder: Path, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: Any, prompt: list[int], new_tokens: int, device: str) -> tuple:
    """(tokens, [new_tokens, V] float32 logits) of transformers' greedy generate()."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack([step[0].float() for step in out.logits])


def greedy_check(folder: Path, device: str, prompts: list, new_tokens: int, max_len: int) -> dict:
    runner = make_runner(folder, device, "float32", "auto", max_len)
    driver = PlanDriver(
        runner.execute, runner.kv_cache.num_blocks, BLOCK_SIZE, CHUNK, shuffle_seed=0
    )
    got = staggered_run(driver, prompts, new_tokens)
    del runner, driver
    model = hf_model(folder, device, torch.float32)
    rows = []
    for i, prompt in enumerate(prompts):
        want, logits = hf_greedy(model, prompt, new_tokens, device)
        mine = got[f"p{i}"]
        first = next((j for j, (a, b) in enumerate(zip(mine, want, strict=True)) if a != b), None)
        row: dict[str, Any] = {"prompt_len": len(prompt), "equal": first is None}
        if first is not None:
            margin = float(logits[first, want[first]] - logits[first, mine[first]])
            row.update(diverged_at=first, hf_margin=margin, near_tie=margin <= NEAR_TIE_FP32)
        rows.append(row)
    ok = all(r["equal"] or r["near_tie"] for r in rows)
    num_equal = sum(r["equal"] for r in rows)
    return {
        "ok": ok,
        "num_prompts": len(rows),
        "num_equal": num_equal,
        "prompts": rows,
        "new_tokens": new_tokens,
        "near_tie_bound": NEAR_TIE_FP32,
    }


# ---- 2. bf16 against fp32 -----------------------------------------------------------------


def last_logits_hf(model: Any, prompts: list, device: str) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [model(torch.tensor([p], device=device)).logits[0, -1].float() for p in prompts]


def prefill_plan(prompts: list, step_id: int) -> StepPlan:
    """A reset plan: the prompts alone in the batch, each computed whole."""
    greedy = SamplingParams(temperature=0.0)
    writer = PlanWriter(first_step_id=step_id)
    news, blocks = [], 0
    for i, p in enumerate(prompts):
        num = -(-len(p) // BLOCK_SIZE)
        rid = f"b{step_id}-{i}"
        news.append(writer.new_sequence(rid, p, len(p), list(range(blocks, blocks + num)), greedy))
        blocks += num
    return writer.plan({n.rid: len(n.token_ids) for n in news}, news)


def bf16_check(folder: Path, device: str, prompts: list, max_len: int) -> dict:
    ref_model = hf_model(folder, device, torch.float32)
    ref = last_logits_hf(ref_model, prompts, device)
    del ref_model
    hf_bf16 = last_logits_hf(hf_model(folder, device, torch.bfloat16), prompts, device)
    runner = make_runner(folder, device, "bfloat16", "auto", max_len)
    mine = runner.compute_logits(prefill_plan(prompts, 0))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).abs().max() / b.pow(2).mean().sqrt())

    engine_err = max(rel(mine[i], ref[i]) for i in range(len(prompts)))
    hf_err = max(rel(hf_bf16[i], ref[i]) for i in range(len(prompts)))
    bound = max(BF16_ERROR_RATIO * hf_err, BF16_ERROR_FLOOR)
    top1 = sum(int(mine[i].argmax() == ref[i].argmax()) for i in range(len(prompts)))
    return {
        "ok": engine_err <= bound,
        "engine_rel_err": engine_err,
        "hf_bf16_rel_err": hf_err,
        "bound": bound,
        "top1_agree": top1,
        "num_prompts": len(prompts),
    }


# ---- 3. Triton against torch on the same plans --------------------------------------------


def same_plans_check(
    folder: Path, device: str, dtype: str, prompts: list, new_tokens: int, max_len: int
) -> dict:
    """fp32: Triton's logits within TRITON_TORCH_RTOL of torch's. bf16: also a torch fp32 worker
    on the same plans; Triton's bf16 error against it may be BF16_ERROR_RATIO x torch's own."""
    sides = {
        "triton": make_runner(folder, device, dtype, "triton", max_len),
        "torch": make_runner(folder, device, dtype, "torch", max_len),
    }
    if dtype != "float32":
        sides["fp32"] = make_runner(folder, device, "float32", "torch", max_len)
    diffs: dict[str, list[float]] = {
        "triton_vs_torch": [],
        "triton_vs_fp32": [],
        "torch_vs_fp32": [],
    }

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.pow(2).mean().sqrt())

    def execute(plan: StepPlan) -> StepResult:
        out = {name: r.compute_logits(plan) for name, r in sides.items()}  # [B, V] float32
        step = sides["torch"].last_tool_step
        assert step is not None
        if not any(step.sample):  # a step of prefill chunks only: nothing sampled
            return StepResult(step_id=plan.step_id, token_ids=[])
        rows = torch.tensor(step.sample, device=out["torch"].device)
        out = {name: logits[rows] for name, logits in out.items()}  # [S, V] sampling rows
        tokens = out["triton"].argmax(-1).tolist()
        for runner in sides.values():  # each worker's histories get the chosen tokens
            runner.record_tokens(tokens)
        diffs["triton_vs_torch"].append(rel(out["triton"], out["torch"]))
        if "fp32" in out:
            diffs["triton_vs_fp32"].append(rel(out["triton"], out["fp32"]))
            diffs["torch_vs_fp32"].append(rel(out["torch"], out["fp32"]))
        return StepResult(step_id=plan.step_id, token_ids=tokens)

    num_blocks = min(r.kv_cache.num_blocks for r in sides.values())
    driver = PlanDriver(execute, num_blocks, BLOCK_SIZE, CHUNK, shuffle_seed=1)
    staggered_run(driver, prompts, new_tokens)
    worst = {k: max(v) for k, v in diffs.items() if v}
    if dtype == "float32":
        bound = TRITON_TORCH_RTOL_FP32
        ok = worst["triton_vs_torch"] <= bound
    else:
        bound = max(BF16_ERROR_RATIO * worst["torch_vs_fp32"], BF16_ERROR_FLOOR)
        ok = worst["triton_vs_fp32"] <= bound
    return {
        "ok": ok,
        "dtype": dtype,
        "num_steps": len(diffs["triton_vs_torch"]),
        "max_rel_diff": worst,
        "bound": bound,
    }


def timed(fn: Callable[..., dict], *args: Any) -> dict:
    start = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, the others still run
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    out["seconds"] = round(time.perf_counter() - start, 2)
    print(
        f"gpu_e2e_correct: {fn.__name__}{args[2:3] if fn is same_plans_check else ''}: "
        f"{ {k: v for k, v in out.items() if k != 'prompts'} }",
        flush=True,
    )
    return out


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--extra-model", type=Path, action="append", default=[])
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", default="20,60", help="min,max prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):  # plain fp32 matmuls on both sides (the default, made sure)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    lo, hi = (int(v) for v in args.prompt_len.split(","))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, vocab, lo, hi, seed=0)
    max_len = hi + args.new_tokens + CHUNK
    checks = {
        "greedy_fp32_vs_transformers": timed(
            greedy_check, args.model, args.device, prompts, args.new_tokens, max_len
        ),
        "bf16_vs_fp32": timed(bf16_check, args.model, args.device, prompts, max_len),
        "triton_vs_torch_fp32": timed(
            same_plans_check, args.model, args.device, "float32", prompts, args.new_tokens, max_len
        ),
        "triton_vs_torch_bf16": timed(
            same_plans_check, args.model, args.device, "bfloat16", prompts, args.new_tokens, max_len
        ),
    }
    for extra in args.extra_model:
        checks[f"triton_vs_torch_bf16[{extra.name}]"] = timed(
            same_plans_check,
            extra,
            args.device,
            "bfloat16",
            prompts[:4],
            max(2, args.new_tokens // 2),  # at least one decode step
            max_len,
        )
    report = {
        "ok": all(c["ok"] for c in checks.values()),
        "device": args.device,
        "model": str(args.model),
        "checks": checks,
    }
    args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
