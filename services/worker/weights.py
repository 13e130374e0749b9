"""Model description and weights: an HF folder's config.json and *.safetensors -> torch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from shared.model_files import read_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The hyper-parameters the forward pass needs, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2-style biases on the q/k/v projections


def model_args(folder: Path) -> ModelArgs:
    """Parse config.json; raise ValueError for an architecture the worker cannot run."""
    cfg = read_config(folder)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else str(cfg.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model {str(folder)!r}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model {str(folder)!r}: activation {cfg['hidden_act']!r} unsupported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"model {str(folder)!r}: rope scaling {rope!r} is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
    )


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The folder's safetensors tensors by name, each read from disk (and cast to `dtype` on
    `device`) only when asked for: a tensor-parallel rank keeps only its shard of each, so at
    most one whole tensor is held at a time during start-up."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: str) -> None:
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model folder {str(folder)!r} has no *.safetensors weights")
        self._dtype, self._device = dtype, device
        self._files = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._files for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name).to(device=self._device, dtype=self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_weights(folder: Path, dtype: torch.dtype, device: str) -> Mapping[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, cast to `dtype` on `device` when read."""
    return CheckpointTensors(folder, dtype, device)


def take(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A required tensor, with a clear error naming it when the checkpoint lacks it."""
    t = weights.get(name)
    if t is None:
        raise ValueError(f"model weights lack tensor {name!r}")
    return t


def take_optional(weights: Mapping[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    return weights.get(name)
