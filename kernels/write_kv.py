"""Write new keys and values into the paged KV cache by slot mapping.

Token t's K/V go to slot `slot_mapping[t]` of the cache, i.e. block `slot // block_size`,
offset `slot % block_size`. The scheduler hands out the slots; the kernel trusts them (checking
would need a host sync) but masks its stores to the cache, so a bad slot is dropped, never
written out of bounds. The reference raises on such a slot instead. An 8-bit cache
(kernels/kv_quant.py) gets each row's codes and its scale in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_dim, check_same_dtype, check_tensor, next_pow2
from kernels.kv_quant import CODE_DTYPES, SCALE_BYTES, quantize_rows, scaled_kind
from kernels.rotary import rotary_ref


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
    kind = scaled_kind(k_cache)
    k_cache[blocks, offsets] = quantize_rows(key, kind) if kind else key
    v_cache[blocks, offsets] = quantize_rows(value, kind) if kind else value


def rotary_write_kv_ref(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:
    """Reference of the fused C++ call: rotary_ref on qkv's q and k views in place, then
    write_kv_ref of its k and v (cast to a float cache's dtype). Returns q [T, H, D]."""
    t, d, hkv = qkv.shape[0], cos_sin_cache.shape[1], k_cache.shape[2]
    q_size = qkv.shape[1] - 2 * hkv * d
    q = qkv[:, :q_size].view(t, -1, d)
    k = qkv[:, q_size : q_size + hkv * d].view(t, hkv, d)
    v = qkv[:, q_size + hkv * d :].view(t, hkv, d)
    rotary_ref(q, k, positions, cos_sin_cache)
    cast = k_cache.dtype if k_cache.is_floating_point() else k.dtype
    write_kv_ref(k.to(cast), v.to(cast), k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _e4m3_bytes(y):
    # float32 in [-448, 448] -> float8 e4m3fn bytes, rounding to nearest (ties away from zero),
    # in plain arithmetic: the interpreter's float8 casts are not the GPU's, this is the same on
    # both
    a = tl.abs(y)
    e = tl.floor(tl.log2(tl.maximum(a, 2.0**-6)))
    e = tl.where(tl.exp2(e + 1.0) <= a, e + 1.0, e)  # log2 is approximate at powers of two
    e = tl.where(tl.exp2(e) > a, e - 1.0, e)
    e = tl.maximum(e, -6.0)  # below 2^-6: subnormals, steps of 2^-9
    m = tl.floor(a / tl.exp2(e - 3.0) + 0.5)  # 8..16 for normals, 0..8 for subnormals
    carry = m >= 16.0
    e = tl.where(carry, e + 1.0, e)
    m = tl.where(carry, 8.0, m)
    normal = m >= 8.0
    e_bits = tl.where(normal, e + 7.0, 0.0)
    m_bits = tl.where(normal, m - 8.0, m)
    top = (e_bits > 15.0) | ((e_bits == 15.0) & (m_bits > 6.0))  # past 448: saturate
    e_bits = tl.where(top, 15.0, e_bits)
    m_bits = tl.where(top, 6.0, m_bits)
    byte = e_bits.to(tl.int32) * 8 + m_bits.to(tl.int32) + tl.where(y < 0, 128, 0)
    return byte.to(tl.uint8)


@triton.jit
def _store_rows(
    cache_ptr, rows, x, mask, offs_h, offs_d, stride_h,
    HEAD_DIM: tl.constexpr, KV_CODES: tl.constexpr,
):  # fmt: skip
    # x [HEADS_PAD, HEAD_DIM_PAD] into the rows at cache_ptr + rows (a scalar offset); 8-bit
    # caches: codes and, after them, each head's scale (kernels/kv_quant.py)
    ptrs = cache_ptr + rows + offs_h[:, None] * stride_h + offs_d[None, :]
    if KV_CODES == 0:
        tl.store(ptrs, x, mask=mask)
    else:
        xf = x.to(tl.float32)
        qmax = 127.0 if KV_CODES == 1 else 448.0
        scale = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30) / qmax  # [HEADS_PAD]
        y = xf / scale[:, None]
        if KV_CODES == 1:
            codes = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
        else:
            codes = _e4m3_bytes(y)
        tl.store(ptrs, codes, mask=mask)
        scale_ptrs = (cache_ptr + rows + offs_h * stride_h + HEAD_DIM).to(
            tl.pointer_type(tl.float32)
        )
        tl.store(scale_ptrs, scale, mask=tl.max(mask.to(tl.int32), axis=1) > 0)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_CODES: tl.constexpr,
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
    _store_rows(k_cache_ptr, block * stride_kcb + offset * stride_kcs, k, mask, offs_h, offs_d,
                stride_kch, HEAD_DIM, KV_CODES)  # fmt: skip
    _store_rows(v_cache_ptr, block * stride_vcb + offset * stride_vcs, v, mask, offs_h, offs_d,
                stride_vch, HEAD_DIM, KV_CODES)  # fmt: skip


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
    cache_dtypes = FLOAT_DTYPES + tuple(CODE_DTYPES.values())
    check_tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=cache_dtypes, device=dev)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), device=dev)
    kind = scaled_kind(k_cache)
    if kind:  # 8-bit rows of codes + scale: any float key
        check_same_dtype(("key", "value"), (key, value))
        check_same_dtype(("k_cache", "v_cache"), (k_cache, v_cache))
    else:
        check_same_dtype(("key", "value", "k_cache", "v_cache"), (key, value, k_cache, v_cache))
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} != value {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    check_dim("key", key, 1, k_cache.shape[2], "the cache's KV heads")
    extra = SCALE_BYTES if kind else 0
    check_dim("key", key, 2, k_cache.shape[3] - extra, "the cache's head_dim")
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
        BLOCK_SIZE=k_cache.shape[1], KV_CODES={"": 0, "int8": 1, "fp8_e4m3": 2}[kind],
    )  # fmt: skip
