"""GGUF's 32-weight block formats as the C++ linear kernel reads them (kernels/csrc/qlinear.cpp).

A `QuantWeight` is a [N, K] weight held as codes and per-block scales: Q4_1 (w = d q + m, q in
0..15), Q4_0 (w = d (q - 8), held as m = -8 d) and Q8_0 (w = d q, q in -128..127). It is built
from a GGUF tensor's raw blocks (`from_gguf_blocks`) or by quantizing fp32 weights with the gguf
package's own quantizers (`quantize`), sliced and joined by rows or block columns (tensor-parallel
shards), and finally packed for the kernel (`pack`). `quant_linear_ref` is the torch reference:
the fp32 dequantized weights through F.linear. `dequantize` gives exactly the fp32 numbers the
gguf package's dequantizer gives (q d is exact in fp32, one rounding for + m).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from kernels._checks import check_tensor

GROUP = 32  # weights per block along K
FORMATS = ("q4_0", "q4_1", "q8_0")
# GGUF type name -> (bytes per block, bits per code)
_LAYOUT = {"q4_0": (18, 4), "q4_1": (20, 4), "q8_0": (34, 8)}


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A [N, K] weight as block codes (one byte each until packed) and fp32 scales."""

    fmt: str  # one of FORMATS
    codes: torch.Tensor  # [N, K] uint8 (4-bit formats, 0..15) or int8 (q8_0)
    d: torch.Tensor  # [N, K / 32] float32
    m: Optional[torch.Tensor]  # [N, K / 32] float32 (4-bit formats), None for q8_0

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def bits(self) -> int:
        return _LAYOUT[self.fmt][1]

    def file_bytes(self) -> int:
        """Bytes in the GGUF block format (what a decode step reads, up to the fp32 scales)."""
        n, k = self.shape
        return n * (k // GROUP) * _LAYOUT[self.fmt][0]

    def rows(self, start: int, end: int) -> QuantWeight:
        """Output features [start, end): a column-parallel shard."""
        m = None if self.m is None else self.m[start:end].clone()
        return QuantWeight(self.fmt, self.codes[start:end].clone(), self.d[start:end].clone(), m)

    def block_cols(self, start: int, end: int) -> QuantWeight:
        """Input features [start, end), both multiples of 32: a row-parallel shard."""
        if start % GROUP or end % GROUP:
            raise ValueError(f"{self.fmt} shards cut K at multiples of {GROUP}: {start}..{end}")
        g0, g1 = start // GROUP, end // GROUP
        m = None if self.m is None else self.m[:, g0:g1].clone()
        return QuantWeight(self.fmt, self.codes[:, start:end].clone(), self.d[:, g0:g1].clone(), m)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: q d + m per block."""
        n, k = self.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        w = q * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.view(n, k)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """The weights stacked along N (fused q/k/v or gate/up); all of one format."""
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1:
        raise ValueError(
            f"cannot fuse weights of formats {sorted(fmts)} into one projection "
            "(use --quantization with one format for all of them, e.g. q8_0)"
        )
    ms = [p.m for p in parts]
    m = None if ms[0] is None else torch.cat(ms)  # type: ignore[arg-type]
    return QuantWeight(parts[0].fmt, torch.cat([p.codes for p in parts]),
                       torch.cat([p.d for p in parts]), m)  # fmt: skip


def from_gguf_blocks(fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight:
    """Decode a GGUF tensor's raw blocks (uint8, [N, K / 32 * block bytes]) of `fmt`."""
    if fmt not in _LAYOUT:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    n, k = shape
    block_bytes = _LAYOUT[fmt][0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, order="C")).view(n, k // GROUP, -1)
    if blocks.shape[-1] != block_bytes:
        raise ValueError(f"{fmt} blocks are {block_bytes} bytes, got {blocks.shape[-1]}")
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if fmt == "q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantWeight(fmt, codes, d, None)
    packed = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]  # [N, G, 16]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(n, k)  # q[j], q[j + 16]
    if fmt == "q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    else:
        m = -8.0 * d  # exact: w = d (q - 8) = d q - 8 d
    return QuantWeight(fmt, codes.contiguous(), d, m)


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """fp32 [N, K] -> `fmt` with the gguf package's reference quantizer (as llama.cpp's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype = getattr(GGMLQuantizationType, fmt.upper())
    raw = gguf_quantize(w.detach().float().cpu().numpy(), qtype)
    return from_gguf_blocks(fmt, raw, (int(w.shape[0]), int(w.shape[1])))


def quant_linear_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Reference: x [M, K] @ dequantize(w)^T in fp32, returned in x's dtype."""
    return F.linear(x.float(), w.dequantize()).to(x.dtype)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A QuantWeight laid out for the kernel's tiles of `tile` output columns."""

    n: int
    k: int
    fmt: str  # one of FORMATS
    qs: torch.Tensor  # uint8 [tiles * K * tile * bits / 8]
    d: torch.Tensor  # float16 [tiles, K / 32, tile]
    m: Optional[torch.Tensor]  # float16 like d for q4_1; None (q4_0: -8 d; q8_0: 0)

    def num_bytes(self) -> int:
        tensors = [self.qs, self.d] + ([self.m] if self.m is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack(w: QuantWeight, tile: int) -> PackedWeight:
    """Tile layout of qlinear.cpp: per tile of `tile` columns, per k, the tile's codes (4-bit:
    byte j = column j | column j + tile/2 << 4); scales per tile, block and column as fp16, as
    the file holds them (ValueError for a scale fp16 cannot hold exactly)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"K must be a multiple of {GROUP}, got {k}")
    tiles = -(-n // tile)
    pad = tiles * tile - n

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [N, X] -> [tiles, X, tile]
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        return t.view(tiles, tile, -1).transpose(1, 2).contiguous()

    codes = by_tile(w.codes.view(torch.uint8))  # [tiles, K, tile]
    if w.bits == 4:
        half = tile // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    m = _half(w.m, "m") if w.fmt == "q4_1" else None
    return PackedWeight(n, k, w.fmt, codes.contiguous().view(-1), by_tile(_half(w.d, "d")),
                        None if m is None else by_tile(m))  # fmt: skip


def _half(t: torch.Tensor, name: str) -> torch.Tensor:
    h = t.half()
    if not torch.equal(h.float(), t.float()):
        raise ValueError(f"block scales {name} must be fp16 numbers (as GGUF stores them)")
    return h


def quant_linear(ext: ModuleType, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] (float32/bfloat16) @ W^T -> [M, N] in x's dtype (reference: quant_linear_ref).
    The C++ side checks the packed sizes; rows are made contiguous here."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32, torch.bfloat16))
    if x.shape[1] != w.k:
        raise ValueError(f"x has {x.shape[1]} features, the weight expects {w.k}")
    return ext.qlinear(x.contiguous(), w.qs, w.d, w.m, w.n, FORMATS.index(w.fmt))
