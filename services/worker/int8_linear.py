"""`--quantization int8`: int8 weights with one scale per output channel, weight-only.

Each weight row is rounded to int8 with its own scale (absmax / 127) and multiplied by the C++
block kernel in fp32 (kernels/csrc/qlinear.cpp): a per-channel int8 row is a Q8_0 row whose 32-
weight blocks all carry the row's scale, so it is packed as one. W8A8 (activations rounded to
int8 per token, torch's int8 GEMM) ran 2.5x faster at 32-512 rows on this CPU but agreed with
fp32 transformers on only 88.3% of next tokens (perplexity x1.030; SmolLM2's outlier features),
below the 97% this format must keep; FBGEMM's dynamic linear (per-tensor activation scales) was
worse (docs/lab/2026-12-quantization.md). So int8 is weight-only, and only when asked.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels.quant import GROUP, QuantWeight, pack
from services.worker.linear import BlockLinear, BlockWeights, Linear, Weight
from services.worker.ops_cpu import try_load_cpu_ext


def per_channel_int8(w: torch.Tensor) -> QuantWeight:
    """[N, K] float -> int8 codes with one scale per row (held as Q8_0 blocks of that scale)."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-30)  # [N]
    codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    d = scale[:, None].expand(-1, w.shape[1] // GROUP).contiguous()
    return QuantWeight("q8_0", codes, d, None)


class Int8Weights(BlockWeights):
    """Linear layers as per-channel int8; the embedding and tied LM head as Q8_0 blocks."""

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
        return BlockLinear(self._ext, pack(per_channel_int8(dense), self._tile), bias)
