"""Teacher-forced quality of a worker setting against fp32 transformers on the same weights.

The text is tests/data/persuasion.txt (public domain; tests/data/README.md). It is cut into
windows of `--window` tokens; in each, every position predicts the next token from the window's
tokens before it. transformers in fp32 on the converted folder (the dequantized weights) is the
reference; a setting is our worker with `--quantization` / `--kv-cache-dtype` / `--dtype`.
Agreement = share of positions whose argmax equals the reference's; perplexity over the text's
own next tokens, as a ratio to the reference's.

    PYTHONPATH=. python bench/quant_quality.py [--tokens 22528] [--window 512]
        [--settings auto,q8_0,q4_0,int8,none/bfloat16,auto//bfloat16,auto//int8]

A setting is QUANTIZATION[/DTYPE[/KV_CACHE_DTYPE]] (empty parts: auto).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.config import WorkerConfig
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.model_files import prepare_model
from shared.protocol.sampling import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "persuasion.txt"


@dataclass(frozen=True)
class WindowStats:
    """Per predicted position of every window: the argmax and the true next token's NLL."""

    argmax: torch.Tensor  # [P] int64
    nll: torch.Tensor  # [P] float64


def text_ids(folder: Path, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of the text (ValueError when it has fewer)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT.read_text()).ids
    if len(ids) < num_tokens:
        raise ValueError(f"{TEXT.name} has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:]) > 1]


def _stats(logits_per_window: list[torch.Tensor], wins: list[list[int]]) -> WindowStats:
    argmax, nll = [], []
    for logits, win in zip(logits_per_window, wins, strict=True):
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)
        target = torch.tensor(win[1:])
        argmax.append(logits[:-1].argmax(dim=-1))
        nll.append(-logp.gather(1, target[:, None])[:, 0])
    return WindowStats(torch.cat(argmax), torch.cat(nll))


def reference_stats(model: Any, wins: list[list[int]]) -> WindowStats:
    """transformers (fp32) logits of every window, reduced to WindowStats."""
    out = []
    with torch.inference_mode():
        for win in wins:
            out.append(model(input_ids=torch.tensor([win])).logits[0].float())
            out[-1] = out[-1].clone()
    return _stats(out, wins)


def engine_stats(runner: ModelRunner, wins: list[list[int]]) -> WindowStats:
    """Our worker's logits at every position of each window (one prefill step per window)."""
    out = []
    bs = runner.kv_cache.block_size
    with torch.inference_mode():
        for win in wins:
            writer = PlanWriter()  # a reset plan: the window alone in the batch
            blocks = list(range(-(-len(win) // bs)))
            new = writer.new_sequence("w", win, len(win), blocks, SamplingParams(temperature=0.0))
            step = runner.held.apply(writer.plan({"w": len(win)}, [new]))
            tensors = runner.inputs.tensors(step, every_row=True)
            every = torch.arange(len(win), dtype=torch.int64)
            tensors = dataclasses.replace(tensors, logits_indices=every)
            logits = runner.model.forward(tensors, runner.kv_cache.layers)
            out.append(logits.float())  # type: ignore[union-attr]
    return _stats(out, wins)


def compare(ref: WindowStats, ours: WindowStats) -> dict[str, float]:
    """Agreement of the argmaxes and the perplexity ratio ours / reference."""
    ppl_ref = math.exp(float(ref.nll.mean()))
    ppl_ours = math.exp(float(ours.nll.mean()))
    return {
        "positions": int(ref.argmax.numel()),
        "agreement": float((ref.argmax == ours.argmax).double().mean()),
        "ppl_reference": ppl_ref,
        "ppl": ppl_ours,
        "ppl_ratio": ppl_ours / ppl_ref,
    }


def setting_config(setting: str, window: int) -> WorkerConfig:
    """QUANTIZATION[/DTYPE[/KV_CACHE_DTYPE]] -> a WorkerConfig sized for one window."""
    parts = (setting.split("/") + ["", ""])[:3]
    quant, dtype, kv = (p or "auto" for p in parts)
    return WorkerConfig(quantization=quant, dtype=dtype, kv_cache_dtype=kv,
                        kv_cache_memory=96 << 20, max_model_len=max(window, 256))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=22528)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--settings", default="auto,q8_0,q4_0,int8,none/bfloat16,auto//bfloat16")
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    folder = prepare_model(None)
    wins = windows(text_ids(folder, args.tokens), args.window)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = reference_stats(hf, wins)
    del hf
    print(f"reference: fp32 transformers, {int(ref.argmax.numel())} positions, "
          f"ppl {math.exp(float(ref.nll.mean())):.4f}", flush=True)  # fmt: skip
    print("| setting | agreement | ppl | ppl ratio |\n|---|---:|---:|---:|")
    for setting in args.settings.split(","):
        runner = ModelRunner(setting_config(setting, args.window))
        r = compare(ref, engine_stats(runner, wins))
        print(f"| {setting} ({runner.quantization}, {runner.dtype_name}, KV "
              f"{runner.kv_cache.dtype_name}) | {100 * r['agreement']:.2f}% | {r['ppl']:.4f} | "
              f"{r['ppl_ratio']:.4f} |", flush=True)  # fmt: skip
        del runner


if __name__ == "__main__":
    main()
