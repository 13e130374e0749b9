"""How a paged-attention launch is shaped (kernels/paged_attention.py): its arguments checked,
rows per program, keys per tile, KV splits and warps, chosen from the shapes alone (no host sync).

Each compile-time parameter takes its value from a few buckets, so the compiled variants are a
small fixed set the worker compiles at start-up (`gpu_variants`): rows per program 16 (decode:
one query per sequence) or 64 (prefill chunks), 64 keys per tile, KV splits a power of two up
to 16 (only batches of decodes too small to fill the GPU split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


BLOCK_M_BUCKETS = (16, 64)  # rows per program on a GPU: decode-only batches, prefill-heavy
TILE_N_GPU = 64  # keys per tile on a GPU
SPLIT_BUCKETS = (1, 2, 4, 8, 16)  # KV splits (NUM_SPLITS) a default launch takes


@dataclass(frozen=True, slots=True)
class Target:
    """What a launch shape depends on besides the tensors' shapes: a GPU (and its number of
    SMs, for split-KV) or the interpreter, and whether fp16/bf16 tiles are upcast to fp32."""

    on_gpu: bool
    num_sms: int
    upcast: bool

    @staticmethod
    def of(device: torch.device, upcast: bool) -> Target:
        if device.type != "cuda":
            return Target(on_gpu=False, num_sms=1, upcast=upcast)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return Target(on_gpu=True, num_sms=sms, upcast=upcast)


def _default_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_kv: int,
                        target: Target) -> int:  # fmt: skip
    # Split the KV range only for an all-decode batch (one query per sequence: T == B) that
    # would not fill the GPU; the split count depends on shapes only, so no host sync, and is
    # a power of two (SPLIT_BUCKETS): one compiled variant per bucket, not per count.
    if not target.on_gpu or num_tokens != num_seqs or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= target.num_sms:
        return 1
    by_fill = math.ceil(2 * target.num_sms / programs)
    by_len = math.ceil(max_kv / 256)  # keep >= ~256 keys (4 tiles) per split
    wanted = min(SPLIT_BUCKETS[-1], by_fill, by_len)
    return max(s for s in SPLIT_BUCKETS if s <= wanted)


def launch_shape(
    q: torch.Tensor,
    num_seqs: int,
    num_kv_heads: int,
    max_kv: int,
    block_m: Optional[int],
    tile_n: Optional[int],
    num_splits: Optional[int],
    target: Target,
) -> tuple[int, int, int]:
    """(rows per program, keys per tile, KV splits): the caller's choice or a default from the
    shapes alone (the buckets above). On a GPU every tl.dot dimension must be >= 16."""
    num_tokens, group = q.shape[0], q.shape[1] // num_kv_heads
    on_gpu = target.on_gpu
    if block_m is None:
        # Prefill-heavy batches (several queries per sequence) take taller blocks; on CPU tall
        # blocks mean fewer interpreted programs.
        block_m = BLOCK_M_BUCKETS[1] if num_tokens > 4 * num_seqs or not on_gpu else 16
    block_m = max(block_m, next_pow2(group), 16 if on_gpu else 1)
    if tile_n is None:
        tile_n = TILE_N_GPU if on_gpu else 128
    if tile_n != next_pow2(tile_n) or (on_gpu and tile_n < 16):
        raise ValueError(f"tile_n must be a power of two (>= 16 on GPU), got {tile_n}")
    if block_m != next_pow2(block_m):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_splits is None:
        num_splits = _default_num_splits(num_tokens, num_seqs, num_kv_heads, max_kv, target)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return block_m, tile_n, num_splits


def gpu_variants() -> list[tuple[int, int]]:
    """(rows per program, KV splits) of every variant a default GPU launch can take: decodes
    with each split bucket, prefill-heavy batches unsplit. The worker compiles each at start-up
    (services/worker/warmup.py); a model whose GQA group exceeds 16 raises the rows to it."""
    decode, prefill = BLOCK_M_BUCKETS
    return [(decode, s) for s in SPLIT_BUCKETS] + [(prefill, 1)]


def num_warps(block_m: int, head_dim: int) -> int:
    # Registers a thread at sm_90 (bench/gpu/compile.py, 64-key tiles, bf16): 16-row blocks
    # 96 (head_dim 64) / 158 (128) with 4 warps; 64-row blocks 174 (64) with 4 warps, 248 (128)
    # with 4 and 186 with 8. None spills; 8 warps keep the largest under ~200.
    return 8 if block_m >= 64 and head_dim > 64 else 4
