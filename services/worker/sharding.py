"""Megatron-style shards of a Llama checkpoint: which rows or columns of each weight a rank keeps.

Column-parallel (output features split, no communication): the fused q/k/v projection (this
rank's query heads, then its KV heads) and the fused gate/up projection (its slice of the
intermediate features). Row-parallel (input features split, followed by one all-reduce): o_proj
and down_proj. Vocab-parallel: the embedding and the LM head keep rows [start, start + n) of
the vocabulary, padded with zero rows to `ceil(V / world_size)` so that every rank's shard has
the same shape (the padding's logits are dropped after the gather).

With world size 1 every shard is the whole tensor (no copy). A weight still in GGUF blocks
(kernels.quant.QuantWeight) shards the same way before it is packed: rows freely, columns only
at multiples of its 32-weight blocks (ValueError otherwise: a world size must split K / 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypeVar

import torch

from kernels.quant import QuantWeight, cat_rows

W = TypeVar("W", torch.Tensor, QuantWeight)


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's share of a model: `rank` of `world_size`."""

    rank: int = 0
    world_size: int = 1

    def span(self, total: int) -> tuple[int, int]:
        """[start, end) of an evenly divisible dimension of size `total`."""
        n = total // self.world_size
        return self.rank * n, (self.rank + 1) * n

    def rows(self, t: W, total: Optional[int] = None) -> W:
        """Rows [start, end) of `t` (dim 0 split evenly)."""
        start, end = self.span(total if total is not None else t.shape[0])
        if isinstance(t, QuantWeight):
            return t if self.world_size == 1 else t.rows(start, end)
        return _keep(t, t[start:end])

    def cols(self, t: W) -> W:
        """Columns [start, end) of `t` [out, in] (dim 1 split evenly): row-parallel layers."""
        start, end = self.span(t.shape[1])
        if isinstance(t, QuantWeight):
            return t if self.world_size == 1 else t.block_cols(start, end)
        return _keep(t, t[:, start:end])

    def vocab_span(self, vocab_size: int) -> tuple[int, int]:
        """[start, start + per_rank) of the padded vocabulary this rank owns."""
        per_rank = -(-vocab_size // self.world_size)
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def vocab_rows(self, t: W) -> W:
        """Rows of `t` [V, Hd] in this rank's vocab span, zero-padded past V: [V_local, Hd]."""
        start, end = self.vocab_span(t.shape[0])
        if self.world_size == 1:
            return t
        if isinstance(t, QuantWeight):
            return _padded_rows(t, start, end)
        out = torch.zeros((end - start, t.shape[1]), dtype=t.dtype, device=t.device)
        real = t[start : min(end, t.shape[0])]
        out[: real.shape[0]] = real
        return out


def fused_rows(shard: Shard, parts: list[W]) -> W:
    """Each tensor's own share of rows, concatenated: a column-parallel fused projection keeps
    [q_local | k_local | v_local] (or [gate_local | up_local]) so that the local split of the
    output mirrors the unsharded one."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return cat_rows([shard.rows(p) for p in parts])  # type: ignore[return-value]
    if any(isinstance(p, QuantWeight) for p in parts):
        raise ValueError(
            "cannot fuse quantized and dense weights into one projection "
            "(use --quantization none, or one block format for all: q8_0)"
        )
    return torch.cat([shard.rows(p) for p in parts]).contiguous()


def _padded_rows(t: QuantWeight, start: int, end: int) -> QuantWeight:
    """Rows [start, end) of a block weight, past its last row zero codes and scales."""
    real = t.rows(start, min(end, t.shape[0]))
    pad = end - start - real.shape[0]
    if pad == 0:
        return real
    zeros = QuantWeight(
        t.fmt,
        torch.zeros((pad, t.shape[1]), dtype=t.codes.dtype),
        torch.zeros((pad, t.d.shape[1])),
        None if t.m is None else torch.zeros((pad, t.m.shape[1])),
    )
    return cat_rows([real, zeros])


def _keep(full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """A slice that owns its memory (so the full tensor can be freed), or `full` itself."""
    return full if part.shape == full.shape else part.clone(memory_format=torch.contiguous_format)
