"""How the model's weights are held and multiplied: one policy object per `--quantization`.

The model asks its policy for each linear layer, the embedding and the LM head, once at start,
and calls what it gets (`Linear`: x [T, in] -> [T, out] in the compute dtype). So a number
format is one policy behind that seam, never a branch in the forward pass:

* `DenseWeights` (`none`, and an unquantized checkpoint under `auto`): tensors in the compute
  dtype through F.linear (torch's GEMM).
* `BlockWeights` (`auto` on a GGUF: the file's own Q4_0/Q4_1/Q8_0 blocks; `q4_0`/`q4_1`/`q8_0`:
  every weight requantized to that format): the C++ weight-only kernel (kernels/csrc/qlinear.cpp),
  dequantizing in registers and multiplying in fp32. A tied embedding keeps its blocks for both
  the lookup and the LM head.
* `Int8Weights` (`int8`): int8 weights, an fp16 scale per 32 along K
  (services/worker/int8_linear.py).

Which kernel serves which shapes, and why, with the figures: docs/lab/2026-12-quantization.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Protocol, Union

import torch
import torch.nn.functional as F

from kernels.quant import FORMATS, GROUP, PackedWeight, QuantWeight, pack, quantize

Weight = Union[torch.Tensor, QuantWeight]


class Linear(Protocol):
    """One linear layer: called once per step with all the step's rows."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]:
        """What it holds (the model counts its weight bytes from these, shared ones once)."""
        ...


class DenseLinear:
    """F.linear on a weight [out, in] in the compute dtype (and an optional bias)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([] if self.bias is None else [self.bias])


class BlockLinear:
    """A packed GGUF block weight through the C++ kernel; output in x's dtype. Called for every
    layer of every step, so it calls the extension directly (the C++ side checks x's shape and
    dtype): `quant_linear`'s Python checks cost 1.3-3.5 us a call (two runs, a 576x576 row),
    and a 1-row step of the default model makes 121 calls."""

    def __init__(
        self, ext: ModuleType, packed: PackedWeight, bias: Optional[torch.Tensor] = None
    ) -> None:
        self._ext = ext
        self.format_code = FORMATS.index(packed.fmt)  # the C++ kernel's number for the format
        self.packed = packed
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        y = self._ext.qlinear(x.contiguous(), p.qs, p.d, p.m, p.n, self.format_code)
        return y if self.bias is None else y.add_(self.bias)

    def tensors(self) -> list[torch.Tensor]:
        p = self.packed
        return [p.qs, p.d] + [t for t in (p.m, self.bias) if t is not None]


class Embedding:
    """Token id -> row of the embedding, from a dense tensor or from blocks (dequantized per
    looked-up row, in the compute dtype)."""

    def __init__(self, weight: Weight, dtype: Optional[torch.dtype]) -> None:
        self.weight = weight
        self.dtype = dtype if dtype is not None else torch.float32

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, Hd]
        w = self.weight
        if isinstance(w, torch.Tensor):
            return w[ids]
        rows = w.codes[ids].float().view(ids.shape[0], -1, GROUP) * w.d[ids][..., None]
        if w.m is not None:
            rows = rows + w.m[ids][..., None]
        return rows.view(ids.shape[0], -1).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        w = self.weight
        if isinstance(w, torch.Tensor):
            return [w]
        return [w.codes, w.d] + ([] if w.m is None else [w.m])


class WeightsPolicy(Protocol):
    """What each weight of the checkpoint becomes; asked once per weight at start."""

    name: str

    def linear(self, weight: Weight, bias: Optional[torch.Tensor] = None) -> Linear: ...

    def embedding(self, weight: Weight) -> Embedding: ...

    def lm_head(self, embedding: Embedding) -> Linear:
        """The LM head of a model with tied embeddings."""
        ...

    def vector(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight, in the compute dtype."""
        ...


def held_bytes(parts: list[Union[Linear, Embedding]]) -> int:
    """Bytes of every tensor the parts hold, a tensor shared by two parts counted once."""
    unique = {t.data_ptr(): _bytes(t) for p in parts for t in p.tensors()}
    return sum(unique.values())


class DenseWeights:
    """`--quantization none`: every weight a tensor in the compute dtype (None: as read)."""

    name = "none"

    def __init__(self, dtype: Optional[torch.dtype]) -> None:
        self.dtype = dtype

    def vector(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.dtype is None else weight.to(self.dtype)

    def linear(self, weight: Weight, bias: Optional[torch.Tensor] = None) -> Linear:
        return DenseLinear(self._dense(weight), bias)

    def embedding(self, weight: Weight) -> Embedding:
        return Embedding(self._dense(weight), self.dtype)

    def lm_head(self, embedding: Embedding) -> Linear:
        """The tied LM head: the embedding's own tensor (no copy)."""
        return DenseLinear(self._dense(embedding.weight))

    def _dense(self, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantWeight):
            return weight.dequantize().to(self.dtype or torch.float32)
        return self.vector(weight)


class BlockWeights(DenseWeights):
    """GGUF block formats through the C++ kernel. `fmt` None: each weight as stored (blocks
    stay blocks, dense tensors stay dense); else every linear weight requantized to `fmt` and
    the embedding / LM head to q8_0 (dense ones too)."""

    def __init__(self, ext: ModuleType, dtype: torch.dtype, fmt: Optional[str] = None) -> None:
        super().__init__(dtype)
        self._ext = ext
        self._fmt = fmt
        self._tile = int(ext.qlinear_tile())
        self.name = fmt or "auto"

    def linear(self, weight: Weight, bias: Optional[torch.Tensor] = None) -> Linear:
        blocks = self._blocks(weight, self._fmt)
        if blocks is None:
            return super().linear(weight, bias)
        return BlockLinear(self._ext, pack(blocks, self._tile), bias)

    def embedding(self, weight: Weight) -> Embedding:
        blocks = self._blocks(weight, "q8_0" if self._fmt else None)
        return Embedding(blocks if blocks is not None else self._dense(weight), self.dtype)

    def lm_head(self, embedding: Embedding) -> Linear:
        if isinstance(embedding.weight, QuantWeight):
            return BlockLinear(self._ext, pack(embedding.weight, self._tile))
        return super().lm_head(embedding)

    def _blocks(self, weight: Weight, fmt: Optional[str]) -> Optional[QuantWeight]:
        if isinstance(weight, QuantWeight):
            if fmt is None or weight.fmt == fmt:
                return weight
            return quantize(weight.dequantize(), fmt)
        if fmt is None or weight.shape[-1] % GROUP:
            return None
        return quantize(weight.float(), fmt)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
