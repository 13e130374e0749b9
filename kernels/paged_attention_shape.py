"""How a paged-attention launch is shaped (kernels/paged_attention.py): its arguments checked,
rows per program, keys per tile, KV splits and warps, chosen from the shapes alone (no host sync).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_same_dtype,
    check_tensor,
    next_pow2,
)
from kernels.kv_quant import CODE_DTYPES, SCALE_BYTES, scaled_kind


def check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """ValueError naming the argument whose shape, dtype or device does not fit (before every
    launch: a kernel would read out of bounds instead)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    cache_dtypes = FLOAT_DTYPES + tuple(CODE_DTYPES.values())
    check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    if scaled_kind(k_cache):  # 8-bit rows: head_dim codes + the row's scale
        check_same_dtype(("k_cache", "v_cache"), (k_cache, v_cache))
        check_dim("k_cache", k_cache, 3, q.shape[2] + SCALE_BYTES, "q's head_dim + 4")
    else:
        check_same_dtype(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
        check_dim("k_cache", k_cache, 3, q.shape[2], "q's head_dim")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"q's {q.shape[1]} heads are not a multiple of the cache's {num_kv_heads} KV heads"
        )
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=dev)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev)
    check_dim("query_start_loc", query_start_loc, 0, seq_lens.shape[0] + 1, "len(seq_lens) + 1")
    check_dim("block_tables", block_tables, 0, seq_lens.shape[0], "len(seq_lens)")
    if not query_start_loc.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError("query_start_loc and seq_lens must be contiguous")


def _default_num_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_kv: int) -> int:
    # Split the KV range only for an all-decode batch (one query per sequence: T == B) that
    # would not fill the GPU; the split count depends on shapes only, so no host sync.
    if q.device.type != "cuda" or q.shape[0] != num_seqs or num_seqs == 0:
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_fill = math.ceil(2 * num_sms / programs)
    by_len = math.ceil(max_kv / 256)  # keep >= ~256 keys (4 tiles) per split
    return max(1, min(16, by_fill, by_len))


def launch_shape(
    q: torch.Tensor,
    num_seqs: int,
    num_kv_heads: int,
    max_kv: int,
    block_m: Optional[int],
    tile_n: Optional[int],
    num_splits: Optional[int],
) -> tuple[int, int, int]:
    """(rows per program, keys per tile, KV splits): the caller's choice or a default from the
    shapes alone. On a GPU every tl.dot dimension must be >= 16."""
    num_tokens, group = q.shape[0], q.shape[1] // num_kv_heads
    on_gpu = q.device.type == "cuda"
    if block_m is None:
        # Prefill-heavy batches (several queries per sequence) take taller blocks; on CPU tall
        # blocks mean fewer interpreted programs.
        block_m = 64 if num_tokens > 4 * num_seqs or not on_gpu else 16
    block_m = max(block_m, next_pow2(group), 16 if on_gpu else 1)
    if tile_n is None:
        tile_n = 64 if on_gpu else 128
    if tile_n != next_pow2(tile_n) or (on_gpu and tile_n < 16):
        raise ValueError(f"tile_n must be a power of two (>= 16 on GPU), got {tile_n}")
    if block_m != next_pow2(block_m):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_splits is None:
        num_splits = _default_num_splits(q, num_seqs, num_kv_heads, max_kv)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return block_m, tile_n, num_splits


def num_warps(block_m: int, head_dim: int) -> int:
    # Registers a thread at sm_90 (bench/gpu/compile.py, 64-key tiles, bf16): 16-row blocks
    # 96 (head_dim 64) / 158 (128) with 4 warps; 64-row blocks 174 (64) with 4 warps, 248 (128)
    # with 4 and 186 with 8. None spills; 8 warps keep the largest under ~200.
    return 8 if block_m >= 64 and head_dim > 64 else 4
