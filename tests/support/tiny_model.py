"""A tiny random Llama as an HF folder, for fast tests of the worker and the other services.

The tokenizer is byte-level BPE over the 256 byte symbols plus ChatML specials and a few merges,
so any text round-trips; ids 0..2 are <|endoftext|>, <|im_start|> (bos), <|im_end|> (eos), as in
SmolLM2. Weights are float32, drawn from a seeded numpy generator (same seed, same model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.model_files import build_byte_level_bpe

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
}


def _byte_symbols() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (same table as tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
    printable += list(range(0xAE, 0x100))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes, strict=True))
    return [chr(table[b]) for b in range(256)]


def _vocab(num_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    symbols = _byte_symbols()
    merges: list[tuple[str, str]] = []
    pieces: list[str] = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("a", "n")]:
        if len(merges) < num_merges:
            merges.append((a, b))
            pieces.append(a + b)
    return SPECIAL_TOKENS + symbols + pieces, merges


def write_tiny_model(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into
    `path`; `overrides` replace config.json entries (e.g. attention_bias=True for Qwen2-style
    biases, tie_word_embeddings=False, vocab_size=...). Returns `path`."""
    from safetensors.numpy import save_file

    tokens, merges = _vocab(num_merges=6)
    cfg = {**DEFAULTS, "vocab_size": len(tokens), "bos_token_id": 1, "eos_token_id": 2}
    cfg.update(overrides)
    if cfg["vocab_size"] < len(tokens):
        raise ValueError(f"vocab_size must be >= {len(tokens)} for the tiny tokenizer")
    tokens += [f"<|unused_{i}|>" for i in range(cfg["vocab_size"] - len(tokens))]
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_weights(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    unused = [t for t in tokens if t.startswith("<|unused_")]
    build_byte_level_bpe(tokens, merges, SPECIAL_TOKENS + unused).save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return path


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(v, hd), "model.norm.weight": norm(hd)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(v, hd)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(hd)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            w[f"{p}self_attn.{name}_proj.weight"] = mat(rows, hd)
            if cfg["attention_bias"]:
                w[f"{p}self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(
                    np.float32
                )
        w[p + "self_attn.o_proj.weight"] = mat(hd, q)
        w[p + "mlp.gate_proj.weight"] = mat(inter, hd)
        w[p + "mlp.up_proj.weight"] = mat(inter, hd)
        w[p + "mlp.down_proj.weight"] = mat(hd, inter)
    return w
