"""Unified paged attention for a mixed batch of prefill chunks and decode tokens.

One launch per layer covers the whole flattened batch: sequence b owns query rows
`query_start_loc[b]:query_start_loc[b+1]` and has `seq_lens[b]` tokens in the paged KV cache
after this step (cached context + its new tokens). Query i of sequence b sits at position
`seq_lens[b] - q_len[b] + i` and attends causally to every cached position <= its own, so a
decode token (q_len 1) sees its whole context and a prefill chunk sees its context plus itself
causally.

Kernel layout (one program = a block of query tokens x all query heads of one KV head):
* grid axis 0 walks query blocks of BLOCK_Q tokens. Sequence b's blocks are numbered from
  `query_start_loc[b] // BLOCK_Q + b`, an upper bound that needs no host sync; a program finds
  its sequence by a binary search of those first block numbers (log2(B) loads, not B).
* grid axis 1 is the KV head. The program's rows are (token, query head) pairs of that KV
  head's group (grouped-query attention), so each K/V tile is loaded once for the whole group
  and a decode token still fills the rows of a matrix-unit tile.
* grid axis 2 splits the KV range (split-KV): each split writes a partial result with its
  running max and sum, and a second kernel merges them. One split writes the output directly.
KV tiles of TILE_N tokens are independent of the cache block size: each tile's tokens are
gathered through the block table. Softmax is online (running max and sum) in fp32, in base 2.
An 8-bit cache (kernels/kv_quant.py: rows of head_dim codes, then the row's fp32 scale) is read
as codes widened by a lookup (fp8 e4m3) or a cast (int8), times the row's scale.

Compiled variants (docs/design/kernel_variants.md): the integers that change every step
(`num_seqs`, the block table's row stride) are not specialized by Triton, and the compile-time
parameters come from the buckets of kernels/paged_attention_shape.py, so a model, dtype and KV
dtype compile a small fixed set of variants, all of them at the worker's start-up.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._checks import check_out, needs_fp32_compute, next_pow2
from kernels.kv_quant import dequantize_rows, fp8_e4m3_table, scaled_kind
from kernels.launch import Launch
from kernels.paged_attention_shape import Target, check_args, launch_shape, num_warps

_LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: exp2(-inf - this) is 0, never NaN.
_NEG_BIG = tl.constexpr(-1.0e30)


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Plain-torch reference: gather each sequence's K/V, masked softmax in fp32."""
    kind = scaled_kind(k_cache)
    if kind:  # 8-bit rows: the reference reads the widened cache
        k_cache, v_cache = dequantize_rows(k_cache, kind), dequantize_rows(v_cache, kind)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_b = q[starts[b] : starts[b + 1]].float()  # [q_len, H, D]
        q_len = q_b.shape[0]
        if q_len == 0:
            continue
        blocks = block_tables[b, : (seq_len + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, H, D]: query head h uses KV head h//g
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale  # [H, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


@triton.jit
def _widen(codes, row_ptrs, ok, lut_ptr, HEAD_DIM: tl.constexpr, KV_CODES: tl.constexpr):
    # 8-bit codes -> fp32 times each row's scale (the fp32 after its HEAD_DIM codes)
    if KV_CODES == 2:
        values = tl.load(lut_ptr + codes.to(tl.int32))  # fp8 e4m3 byte -> its value
    else:
        values = codes.to(tl.float32)
    scale = tl.load((row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
    return values, scale


@triton.jit
def _attend_tiles(
    q, q_pos, kv_end, tile_lo, tile_hi, table_row, k_base, v_base,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, lut_ptr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_CODES: tl.constexpr,
):  # fmt: skip
    # Online softmax of q [BLOCK_M, HEAD_DIM_PAD] over key tiles [tile_lo, tile_hi) of one
    # sequence and KV head; keys after a row's position q_pos (or at/after kv_end) are hidden.
    # Returns the unnormalized accumulator, the running max (log2 domain) and the running sum.
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # int64 key positions: the interpreter checks every int32 add for overflow, int64 ones not.
    offs_n = tl.arange(0, TILE_N).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_N + offs_n  # [TILE_N]
        kv_ok = kv_pos < kv_end
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
        k_off = block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        k = tl.load(  # [HEAD_DIM_PAD, TILE_N]
            k_base + k_off,
            mask=d_ok[:, None] & kv_ok[None, :],
            other=0.0,
        )
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
        v = tl.load(  # [TILE_N, HEAD_DIM_PAD]
            v_base + v_off,
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if KV_CODES != 0:  # 8-bit rows: widen, then scale per key (k's columns, v's rows)
            rows = block * stride_kb + slot * stride_ks  # [TILE_N]
            k, k_scale = _widen(k, k_base + rows, kv_ok, lut_ptr, HEAD_DIM, KV_CODES)
            v, v_scale = _widen(v, v_base + block * stride_vb + slot * stride_vs, kv_ok,
                                lut_ptr, HEAD_DIM, KV_CODES)  # fmt: skip
            k = (k * k_scale[None, :]).to(q.dtype)
            v = (v * v_scale[:, None]).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    return acc, m_i, l_i


@triton.jit
def _sequence_of_block(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q: tl.constexpr):
    # Sequence b's first query block is query_start_loc[b] // BLOCK_Q + b, strictly increasing
    # in b and 0 for b = 0: the block's sequence is the last b whose first block is <=
    # q_block_id, found by halving [lo, lo + n) (lo always qualifies). A fixed 20 halvings
    # (batches up to 2^20 sequences; once n is 1 they re-read lo): a data-dependent while loop
    # makes the fp32 variant keep 8 bytes on the stack at sm_90.
    lo = q_block_id * 0
    n = num_seqs
    for _ in range(0, 20):
        half = n // 2
        mid = lo + half
        lo = tl.where(tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_id, mid, lo)
        n -= half
    return lo


@triton.jit
def _store_result(
    out_ptr, part_out_ptr, part_ml_ptr, acc, m_i, l_i, q_rows, head, row_ok, split,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    # One split: the normalized rows into out. Several: this split's partial result into
    # [T, H, NUM_SPLITS, HEAD_DIM_PAD] and its (max, sum) into [T, H, NUM_SPLITS, 2].
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        o_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (q_rows * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        p_off = part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(part_out_ptr + p_off, out, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, lut_ptr,
    num_seqs, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_CODES: tl.constexpr,
):  # fmt: skip
    # (Helpers kept few: the interpreter re-patches triton.language on every call of a jitted
    # helper, and these run once per program.)
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of_block(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return  # the upper-bound grid has a few spare blocks per sequence
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    # Rows are (token, head-of-group) pairs: row r = token r // GROUP, head r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = first_q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_rows = (q_start + tok).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block needs: up to the position of its last query (causal). Plain integer
    # ceil-divisions: tl.cdiv is a jitted helper, costly in the interpreter.
    kv_end = context_len + tl.minimum(first_q + BLOCK_Q, q_len)
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    acc, m_i, l_i = _attend_tiles(
        q, context_len + tok, kv_end, tile_lo, tile_hi,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, lut_ptr,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_M, TILE_N, UPCAST, DOT_PRECISION, KV_CODES,
    )  # fmt: skip
    _store_result(
        out_ptr, part_out_ptr, part_ml_ptr, acc, m_i, l_i, q_rows, head, row_ok, split,
        stride_ot, stride_oh, GROUP, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_ml_ptr, out_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    # One program per (token, head): weight each split by 2^(max_s - max) * sum_s.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=_NEG_BIG)
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0)) * l_s
    o_ptr = part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
    o = tl.load(o_ptr, mask=s_ok[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    o_off = token * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32, query_start_loc[0] == 0
    seq_lens: torch.Tensor,  # [B] int32, cached + new tokens per sequence
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    *,
    num_splits: Optional[int] = None,
    tile_n: Optional[int] = None,
    block_m: Optional[int] = None,
    out: Optional[torch.Tensor] = None,  # [T, H, D], written in full when given
) -> torch.Tensor:  # [T, H, D]
    """Causal paged attention over a flattened mixed batch (see the module docstring).

    `out` receives the result when given (tests poison it to prove every element is written).
    `num_splits`, `tile_n` (keys per tile, a power of two) and `block_m` (rows per program, a
    power of two >= the GQA group) override the shape-based defaults; tests use them to reach
    every code path. Block-table entries and lengths are trusted (reading them would need a
    host sync); every load is masked to the positions they describe.
    """
    check_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(q)
    check_out("out", out, q, tuple(q.shape))
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    target = Target.of(q.device, upcast=needs_fp32_compute(q))
    for launch in attention_launches(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out, target,
        num_splits=num_splits, tile_n=tile_n, block_m=block_m,
    ):  # fmt: skip
        launch.run()
    return out


def attention_launches(
    q: torch.Tensor,  # [T, H, D], T >= 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,  # [B], B >= 1
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    target: Target,
    *,
    num_splits: Optional[int] = None,
    tile_n: Optional[int] = None,
    block_m: Optional[int] = None,
) -> list[Launch]:
    """The kernel launches of one paged_attention call (arguments already checked), built
    without running them: paged_attention runs them; tests read their compile keys for a GPU
    (kernels/launch.py) from tensors on the meta device."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    max_kv = block_tables.shape[1] * block_size
    block_m, tile_n, splits = launch_shape(
        q, num_seqs, num_kv_heads, max_kv, block_m, tile_n, num_splits, target
    )
    group = num_heads // num_kv_heads
    block_q = block_m // group
    upcast = target.upcast
    kind = scaled_kind(k_cache)
    lut = fp8_e4m3_table(q.device) if kind == "fp8_e4m3" else seq_lens  # unused unless fp8
    part_out, part_ml = _partials(q, splits)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    attend = Launch(_unified_attention_kernel, grid, (
        q, k_cache, v_cache, out, part_out, part_ml,
        query_start_loc, seq_lens, block_tables, lut,
        num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
    ), dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        NUM_SPLITS=splits, UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
        KV_CODES={"": 0, "int8": 1, "fp8_e4m3": 2}[kind],
        num_warps=num_warps(block_m, head_dim),
    ))  # fmt: skip
    if splits == 1:
        return [attend]
    merge = Launch(_merge_splits_kernel, (num_tokens, num_heads), (
        part_out, part_ml, out, out.stride(0), out.stride(1),
    ), dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
    ))  # fmt: skip
    return [attend, merge]


def _partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partial results [T, H, NUM_SPLITS, HEAD_DIM_PAD] and their (max, sum)
    [T, H, NUM_SPLITS, 2] in fp32; with one split, placeholders the kernel never touches."""
    if num_splits == 1:
        return q, q
    num_tokens, num_heads, head_dim = q.shape
    size = (num_tokens, num_heads, num_splits)
    part_out = torch.empty((*size, next_pow2(head_dim)), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((*size, 2), dtype=torch.float32, device=q.device)
    return part_out, part_ml
