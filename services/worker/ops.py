"""TorchOps: the model's small kernels in plain torch (the CPU path; the reference on CUDA).

The model calls these only through an ops object, so `services.worker.ops_triton.TritonOps`
(same methods, same signatures: docs/design/contracts.md) can replace it.

Paged attention is batched, never a loop over tokens: the sequences of a step are split into at
most two groups, decodes (one query each) and chunks (several queries), and each group becomes one
padded SDPA call over K/V gathered from the block pool by block table. The gather indices and masks
depend only on the step's metadata, so they are built once per step and reused by every layer
(memoized on the identity of the metadata tensors, which the runner builds once per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_rows, quantize_rows, scaled_kind


@dataclass(frozen=True, slots=True)
class _Group:
    """Sequences attended together: one SDPA call with padded queries and keys."""

    num_seqs: int  # Bg
    q_len: int  # Lq, the longest query run in the group
    num_blocks: int  # nb, the longest block table in the group; keys padded to nb * bs
    q_index: torch.Tensor  # [Bg * Lq] int64 flat query row of each (seq, i); padding -> valid
    valid: torch.Tensor  # [sum q_len] int64 positions in [Bg * Lq] that are real queries
    out_rows: torch.Tensor  # [sum q_len] int64 flat output row of each real query
    blocks: torch.Tensor  # [Bg * nb] int64 block ids, row by row (padding -> block 0)
    mask: torch.Tensor  # [Bg, 1, Lq, nb * bs] additive: 0 where query i may see key j, else -inf


class TorchOps:
    """Plain-torch ops. Stateless except the per-step attention plan memo (see module doc)."""

    name = "torch"

    def __init__(self) -> None:
        self._memo_key: Optional[tuple[torch.Tensor, ...]] = None
        self._memo_groups: list[_Group] = []

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        hkv, row = k_cache.shape[2], k_cache.shape[3]
        kind = scaled_kind(k_cache)  # 8-bit rows carry their scale (kernels/kv_quant.py)
        k = quantize_rows(key, kind) if kind else key.to(k_cache.dtype)
        v = quantize_rows(value, kind) if kind else value.to(v_cache.dtype)
        k_cache.view(-1, hkv, row).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, hkv, row).index_copy_(0, slot_mapping, v)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) D], q and k rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # q [T, H, D], a view of qkv
        return rotary_then_write(
            self, qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    def native_layer(
        self, input_norm: torch.Tensor, post_norm: torch.Tensor, linears: Sequence[Any]
    ) -> None:
        """No whole-layer kernel here: the model runs its Python layer (CpuOps has one)."""
        return None

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,  # [B+1] int32
        seq_lens: torch.Tensor,  # [B] int32, context after this step
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        t, h, d = q.shape
        bs, hkv, row = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        kind = scaled_kind(k_cache)
        group_size = h // hkv
        out = q.new_empty(t, h, d)
        for g in self._groups(query_start_loc, seq_lens, block_tables, bs, q.dtype):
            bg, lq, ctx = g.num_seqs, g.q_len, g.num_blocks * bs
            # queries sharing a KV head become rows of one matrix: [Bg, Hkv, G*Lq, D]
            qg = q.index_select(0, g.q_index).view(bg, lq, hkv, group_size, d)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(bg, hkv, group_size * lq, d)
            # whole blocks are gathered as rows of a 2-D view: a few large row copies (3x faster
            # than index_select over the 4-D cache on this CPU), not one copy per token
            # a compact cache (bf16/fp16 storage) is widened to q's dtype after the gather
            kg = _gather_blocks(k_cache, g.blocks).view(bg, ctx, hkv, row)
            vg = _gather_blocks(v_cache, g.blocks).view(bg, ctx, hkv, row)
            if kind:
                kg, vg = dequantize_rows(kg, kind), dequantize_rows(vg, kind)
            kg, vg = kg.to(q.dtype).transpose(1, 2), vg.to(q.dtype).transpose(1, 2)
            mask = g.mask.expand(bg, group_size, lq, ctx).reshape(bg, 1, group_size * lq, ctx)
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
            og = og.view(bg, hkv, group_size, lq, d).permute(0, 3, 1, 2, 4).reshape(bg * lq, h, d)
            out.index_copy_(0, g.out_rows, og.index_select(0, g.valid))
        return out

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, Hd]
        weight: torch.Tensor,  # [Hd]
        eps: float,
        residual: Optional[torch.Tensor] = None,  # [T, Hd]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        res = x if residual is None else x + residual
        xf = res.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), res

    def rotary(
        self,
        q: torch.Tensor,  # [T, H, D], rotated in place
        k: torch.Tensor,  # [T, Hkv, D], rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D] = [cos(D/2) | sin(D/2)], float32
    ) -> None:
        half = cos_sin_cache.shape[1] // 2
        cs = cos_sin_cache[positions]
        cos = cs[:, None, :half]  # [T, 1, D/2]
        sin = cs[:, None, half:]
        for x in (q, k):
            # .float() is a view for fp32: compute both halves before writing either
            x1 = x[..., :half].float()
            x2 = x[..., half:].float()
            out1 = x1 * cos - x2 * sin
            out2 = x2 * cos + x1 * sin
            x[..., :half] = out1.to(x.dtype)
            x[..., half:] = out2.to(x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        inter = x.shape[-1] // 2
        return F.silu(x[:, :inter]) * x[:, inter:]

    def _groups(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        dtype: torch.dtype,
    ) -> list[_Group]:
        key = (query_start_loc, seq_lens, block_tables)
        memo = self._memo_key
        if memo is not None and all(a is b for a, b in zip(key, memo, strict=True)):
            return self._memo_groups
        qsl = query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        groups = []
        for members in (q_lens == 1, q_lens > 1):
            idx = members.nonzero().flatten()
            if idx.numel() > 0:
                groups.append(
                    _build_group(
                        qsl[idx],
                        q_lens[idx],
                        seq_lens[idx].long(),
                        block_tables[idx],
                        block_size,
                        dtype,
                    )
                )
        # holding the tensors keeps their ids from being reused by a later step's tensors
        self._memo_key, self._memo_groups = key, groups
        return groups


def rotary_then_write(
    ops: Any,
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, row]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary_write_kv` as two of `ops`' own calls (the reference of the fused C++ call):
    split qkv into views, rotate q and k in place, write k and v. Returns q [T, H, D]."""
    t, d, hkv = qkv.shape[0], cos_sin_cache.shape[1], k_cache.shape[2]
    q_size, kv_size = qkv.shape[1] - 2 * hkv * d, hkv * d
    q = qkv[:, :q_size].view(t, q_size // d, d)
    k = qkv[:, q_size : q_size + kv_size].view(t, hkv, d)
    v = qkv[:, q_size + kv_size :].view(t, hkv, d)
    ops.rotary(q, k, positions, cos_sin_cache)
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def _build_group(
    starts: torch.Tensor,  # [Bg] first flat query row
    q_lens: torch.Tensor,  # [Bg]
    seq_lens: torch.Tensor,  # [Bg]
    block_tables: torch.Tensor,  # [Bg, max_blocks]
    block_size: int,
    dtype: torch.dtype,
) -> _Group:
    lq = int(q_lens.max())
    nb = -(-int(seq_lens.max()) // block_size)
    dev = q_lens.device  # the step's device: CUDA ops refuse CPU operands
    i = torch.arange(lq, device=dev)
    q_valid = i[None, :] < q_lens[:, None]  # [Bg, Lq]
    q_index = starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)
    q_pos = seq_lens[:, None] - q_lens[:, None] + i[None, :]  # absolute position of each query
    j = torch.arange(nb * block_size, device=dev)
    allowed = j[None, None, :] <= q_pos[:, :, None]  # causal; also hides keys >= seq_len
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, float("-inf"))
    return _Group(
        num_seqs=int(starts.shape[0]),
        q_len=lq,
        num_blocks=nb,
        q_index=q_index.flatten(),
        valid=q_valid.flatten().nonzero().flatten(),
        out_rows=q_index[q_valid],
        blocks=block_tables[:, :nb].long().flatten(),
        mask=mask[:, None],
    )


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], blocks [n] -> [n, bs * Hkv * D] (contiguous copy)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)
