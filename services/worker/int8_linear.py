"""`--quantization int8`: per-output-channel int8 weights, activations quantized per token (W8A8).

Each call rounds every row of the activations to int8 with its own scale (absmax / 127), runs
torch's int8 GEMM (`torch._int_mm`: int32 sums, VNNI where the CPU has it) and rescales the sums
by the row's and the output channel's scales. On SmolLM2's layer shapes the int8 GEMM ran
3.5-5x the fp32 GEMM at 32-512 rows (docs/lab/2026-12-quantization.md). FBGEMM's dynamic linear
(`quantized::linear_dynamic`) is as fast but scales the activations per tensor, and SmolLM2's
outlier features then cost the greedy token on a plain prompt; torch's weight-only int8 kernel
(`_weight_int8pack_mm`) is scalar for fp32 activations. Lossier than the GGUF formats, so it
runs only when asked. The embedding and the tied LM head stay Q8_0 blocks (weight-only).
"""

from __future__ import annotations

from typing import Optional

import torch

from services.worker.linear import BlockWeights, Linear, Weight
from services.worker.ops_cpu import try_load_cpu_ext


class Int8Linear:
    """x [T, in] -> [T, out] in x's dtype; weight int8 per output channel (absmax / 127)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        w = weight.detach().float()
        self._sw = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        self._wt = (w / self._sw[:, None]).round_().to(torch.int8).t().contiguous()  # [in, out]
        self._bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # [T, 1]
        xq = (xf / sx).round_().to(torch.int8)
        y = torch._int_mm(xq, self._wt).float().mul_(sx).mul_(self._sw)
        if self._bias is not None:
            y.add_(self._bias)
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self._wt, self._sw] + ([] if self._bias is None else [self._bias])


class Int8Weights(BlockWeights):
    """Linear layers as Int8Linear; the embedding and tied LM head as BlockWeights("q8_0")."""

    def __init__(self, dtype: torch.dtype) -> None:
        ext = try_load_cpu_ext()
        if ext is None:
            raise ValueError("quantization=int8 needs the C++ CPU extension for its LM head")
        super().__init__(ext, dtype, "q8_0")
        self.name = "int8"

    def linear(self, weight: Weight, bias: Optional[torch.Tensor] = None) -> Linear:
        return Int8Linear(self._dense(weight).float(), bias)
