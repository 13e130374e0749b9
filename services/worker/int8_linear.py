"""`--quantization int8`: int8 weights with one fp16 scale per 32 weights along K, weight-only.

Each group of GROUP_SIZE weights of a row is rounded to int8 with its own scale (absmax / 127,
rounded to fp16 first) and multiplied by the C++ block kernel in fp32 (kernels/csrc/qlinear.cpp)
as Q8_0 blocks. The group size was measured over the quality text (bench/quant_quality.py):
next-token agreement with fp32 transformers 96.45% with one scale per output channel, 97.11%
per 64 and 97.67% per 32 weights, at the same speed (the kernel reads one fp16 scale per 32
codes whatever the group). W8A8 (activations rounded to int8 per token, torch's int8 GEMM) ran
2.5x faster at 32-512 rows on this CPU but agreed on only 88.3% (SmolLM2's outlier features);
FBGEMM's dynamic linear was worse (docs/lab/2026-12-quantization.md). So int8 is weight-only,
and only when asked.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.quant import GROUP, QuantWeight, pack
from services.worker.linear import BlockLinear, BlockWeights, Linear, Weight
from services.worker.ops_cpu import try_load_cpu_ext

GROUP_SIZE = 32  # weights per int8 scale along K (a multiple of 32; see the module docstring)


def groupwise_int8(w: torch.Tensor, group: int = GROUP_SIZE) -> QuantWeight:
    """[N, K] float -> int8 codes with one fp16 scale per `group` weights along K (absmax / 127,
    rounded to fp16 first, the codes rounded against that very scale); held as Q8_0 blocks, a
    scale of `group` > 32 repeated over its blocks. `group` = K: one scale per output channel."""
    w = w.detach().float()
    n, k = w.shape
    group = min(group, k)
    if group % GROUP or k % group:
        raise ValueError(f"int8 groups must be a multiple of {GROUP} dividing K={k}, got {group}")
    blocks = w.view(n, k // group, group)
    scale = (blocks.abs().amax(dim=2) / 127.0).half().float().clamp_min(2.0**-24)  # [N, K/g]
    codes = (blocks / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
    d = scale.repeat_interleave(group // GROUP, dim=1).contiguous()  # [N, K / 32]
    return QuantWeight("q8_0", codes, d, None)


class Int8Weights(BlockWeights):
    """Linear layers as group-wise int8; the embedding and tied LM head as Q8_0 blocks."""

    def __init__(self, dtype: torch.dtype) -> None:
        ext = try_load_cpu_ext()
        if ext is None:
            raise ValueError("quantization=int8 needs the C++ CPU extension")
        super().__init__(ext, dtype, "q8_0")
        self.name = "int8"

    def linear(self, weight: Weight, bias: Optional[torch.Tensor] = None) -> Linear:
        dense = weight.dequantize() if isinstance(weight, QuantWeight) else weight
        if dense.shape[-1] % GROUP:
            return super().linear(weight, bias)
        return BlockLinear(self._ext, pack(groupwise_int8(dense, GROUP_SIZE), self._tile), bias)
