"""Random-weight model folders for the GPU end-to-end run, built where they run.

Two shapes, written as Hugging Face folders (config.json, model.safetensors in bfloat16,
tokenizer.json, tokenizer_config.json) that both the engine and transformers load:

* `smollm2`: SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab
  49,152, tied embeddings); the real GGUF is 97 MB and cannot travel to the device, so only
  its tokenizer files do (`make gpu-wheels` puts them in `.gpu/smollm2/`).
* `llama-1b`: Llama-3.2-1B's shapes (16 layers, hidden 2048, 32 query / 8 KV heads of 64,
  intermediate 8192, vocab 128,256, tied). Its `rope_scaling` ("llama3") is left out: the
  worker implements plain rotary only, and the scaling changes no shape or cost. It uses the
  SmolLM2 tokenizer with its vocabulary padded by `<|reserved_N|>` entries up to 128,256, so
  every id the model can sample decodes.

`--tiny` keeps each config but shrinks the sizes (CPU dry run). Weights: normal, scaled by
1/sqrt(fan-in) (logits O(1)), norms 1, from a seeded generator on `--device`; saved in bfloat16
so the 1B folder is 2.5 GB (both engines read the same rounded values, so fp32 comparisons
stay exact). Imports torch, safetensors and the standard library only.

    python bench/gpu/e2e_models.py --out DIR --tokenizer-from DIR [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}
LLAMA_32_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
}
# --tiny: the same families at CPU sizes (head_dim 64 kept: the kernels' common case). The
# 1B stand-in keeps Llama-3's 128,256-id vocabulary, so the padded tokenizer is served as is.
TINY: dict[str, dict[str, Any]] = {
    "smollm2": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    "llama-1b": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 128256,
    },
}
COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
SHAPES = {"smollm2": SMOLLM2_135M, "llama-1b": LLAMA_32_1B}
NAMES = {"smollm2": "SmolLM2-135M-shaped-random", "llama-1b": "Llama-3.2-1B-shaped-random"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_config(kind: str, tiny: bool) -> dict[str, Any]:
    """config.json of one shape (`kind`: smollm2 | llama-1b)."""
    cfg = {**COMMON, **SHAPES[kind], **(TINY[kind] if tiny else {})}
    cfg["conveyor_model_name"] = NAMES[kind] + ("-tiny" if tiny else "")
    return cfg


def random_weights(cfg: dict[str, Any], seed: int, device: str) -> dict[str, Any]:
    """HF-named bfloat16 tensors on the CPU (ready to save), drawn on `device`."""
    import torch

    if device == "cpu":  # half the cores: the stage beside this one (gpu_check) keeps the rest
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    gen = torch.Generator(device=device).manual_seed(seed)
    hd, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def mat(rows: int, cols: int) -> torch.Tensor:  # [rows, cols], std 1/sqrt(cols)
        w = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
        return (w * cols**-0.5).to(torch.bfloat16).cpu()

    ones = torch.ones(hd, dtype=torch.bfloat16)
    out = {"model.embed_tokens.weight": mat(vocab, hd), "model.norm.weight": ones}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ones.clone()
        out[p + "post_attention_layernorm.weight"] = ones.clone()
        out[p + "self_attn.q_proj.weight"] = mat(q, hd)
        out[p + "self_attn.k_proj.weight"] = mat(kv, hd)
        out[p + "self_attn.v_proj.weight"] = mat(kv, hd)
        out[p + "self_attn.o_proj.weight"] = mat(hd, q)
        out[p + "mlp.gate_proj.weight"] = mat(inter, hd)
        out[p + "mlp.up_proj.weight"] = mat(inter, hd)
        out[p + "mlp.down_proj.weight"] = mat(hd, inter)
    return out


def padded_tokenizer(tokenizer_json: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The tokenizer with `<|reserved_N|>` vocabulary entries up to `vocab_size` ids, so that
    every sampled id decodes; encoding is unchanged (no merge produces them)."""
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    for token_id in range(vocab_size):
        if token_id not in used:
            vocab[f"<|reserved_{token_id}|>"] = token_id
    return tokenizer_json


def write_model(
    kind: str, out: Path, tokenizer_from: Path, device: str, tiny: bool, seed: int = 0
) -> dict[str, Any]:
    """Write one folder; returns what the report records about it."""
    from safetensors.torch import save_file

    start = time.perf_counter()
    cfg = model_config(kind, tiny)
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(cfg, seed, device)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = padded_tokenizer(
        json.loads((tokenizer_from / "tokenizer.json").read_text()), cfg["vocab_size"]
    )
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tok_cfg = json.loads((tokenizer_from / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    num_params = sum(t.numel() for t in weights.values())
    return {
        "kind": kind,
        "folder": str(out),
        "name": cfg["conveyor_model_name"],
        "num_params": num_params,
        "config": {k: cfg[k] for k in SHAPES[kind]},
        "seconds": round(time.perf_counter() - start, 2),
    }


def default_tokenizer_folder() -> Path:
    """`.gpu/smollm2` (the device: `make gpu-wheels` put it there), else the converted
    SmolLM2 in the model cache (here: `conveyor model prepare`)."""
    packed = ROOT / ".gpu" / "smollm2"
    if packed.is_dir():
        return packed
    sys.path.insert(0, str(ROOT))
    from shared.model_files import prepare_model

    return prepare_model(None)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="one sub-folder per model goes here")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        help="a folder with SmolLM2's tokenizer.json and tokenizer_config.json "
        "(default: .gpu/smollm2, else the converted SmolLM2)",
    )
    p.add_argument("--models", default="smollm2,llama-1b")
    p.add_argument("--device", default="cpu", help="where the random numbers are drawn")
    p.add_argument("--tiny", action="store_true", help="CPU sizes (dry run)")
    p.add_argument("--json", type=Path, help="write the summary here")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.tokenizer_from is None:
        args.tokenizer_from = default_tokenizer_folder()
    missing = [f for f in TOKENIZER_FILES if not (args.tokenizer_from / f).is_file()]
    if missing:
        print(f"gpu_e2e_models: {args.tokenizer_from} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    kinds = [k for k in args.models.split(",") if k]
    unknown = [k for k in kinds if k not in SHAPES]
    if unknown:
        print(
            f"gpu_e2e_models: unknown model {unknown}; choose from {sorted(SHAPES)}",
            file=sys.stderr,
        )
        return 2
    models = {}
    for kind in kinds:
        models[kind] = write_model(
            kind, args.out / kind, args.tokenizer_from, args.device, args.tiny
        )
        print(f"gpu_e2e_models: {kind}: {models[kind]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"ok": True, "models": models}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
