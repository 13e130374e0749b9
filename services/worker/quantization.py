"""The weights policy for a resolved `--quantization` (config.resolve_quantization), chosen
once at start by the runner (the policies themselves: linear.py, int8_linear.py)."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from services.worker.int8_linear import Int8Weights
from services.worker.linear import BlockWeights, DenseWeights, WeightsPolicy


def make_policy(quantization: str, dtype: torch.dtype, ext: Optional[ModuleType]) -> WeightsPolicy:
    """The policy for a resolved quantization (config.resolve_quantization); the block
    formats need the C++ extension (ValueError without it)."""
    if quantization == "none":
        return DenseWeights(dtype)
    if ext is None:
        raise ValueError(
            f"quantization={quantization} needs the C++ CPU extension, which did not build "
            "(see the cpu_ext_unavailable log line), or use --quantization none"
        )
    if quantization == "gguf":
        return BlockWeights(ext, dtype)
    if quantization == "int8":
        return Int8Weights(dtype)
    return BlockWeights(ext, dtype, quantization)
