"""Write new keys and values into the paged KV cache by slot mapping.

Token t's K/V go to slot `slot_mapping[t]` of the cache, i.e. block `slot // block_size`,
offset `slot % block_size`. The scheduler hands out the slots; the kernel trusts them (checking
would need a host sync) but masks its stores to the cache, so a bad slot is dropped, never
written out of bounds. The reference raises on such a slot instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_dim, check_same_dtype, check_tensor, next_pow2


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Plain-torch reference: scatter rows into the caches in place."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and (slot_mapping.min() < 0 or slot_mapping.max() >= num_slots):
        raise ValueError(f"slot_mapping holds a slot outside [0, {num_slots})")
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    # One program per token: all its heads as one [HEADS_PAD, HEAD_DIM_PAD] tile.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # tl.where, not `&`: the interpreter rejects a mask made of a block & a scalar.
    mask = tl.where((slot >= 0) & (slot < num_slots), mask, False)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    kc = block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_cache_ptr + kc, k, mask=mask)
    tl.store(v_cache_ptr + vc, v, mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Copy each token's K/V into its cache slot, in place (called once per layer per step)."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    dev = key.device
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=dev)
    check_same_dtype(("key", "value", "k_cache", "v_cache"), (key, value, k_cache, v_cache))
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} != value {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    check_dim("key", key, 1, k_cache.shape[2], "the cache's KV heads")
    check_dim("key", key, 2, k_cache.shape[3], "the cache's head_dim")
    check_dim("slot_mapping", slot_mapping, 0, key.shape[0], "the number of tokens")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[0] * k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=key.shape[1], HEAD_DIM=key.shape[2],
        HEADS_PAD=next_pow2(key.shape[1]), HEAD_DIM_PAD=next_pow2(key.shape[2]),
        BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip
