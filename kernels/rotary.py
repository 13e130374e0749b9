"""Rotary position embedding, in place on q and k (GPT-NeoX / HF Llama "rotate_half" layout).

Each head vector is split in halves x1 = x[:D/2], x2 = x[D/2:]; with c, s the cos and sin of
the token's position: x1' = x1*c - x2*s, x2' = x2*c + x1*s. `cos_sin_cache[pos]` holds
`[cos(D/2) | sin(D/2)]`. Computed in fp32 and rounded once. q and k may be views (e.g. slices of a
fused QKV projection) as long as their last dimension is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_dim, check_tensor, next_pow2


def rotary_ref(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> None:
    """Plain-torch reference, in place."""
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].float()  # [T, D]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))


@triton.jit
def _rotate_heads(x_ptr, row_off, stride_h, cos, sin, num_heads,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):  # fmt: skip
    # Rotate all heads of one token: a [HEADS_PAD, HALF_PAD] tile per half.
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptr1 = x_ptr + row_off + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads, max_pos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):  # fmt: skip
    # One program per token. A position outside the cache rotates nothing (the launcher cannot
    # check positions without a host sync; masking keeps the loads in bounds).
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, HALF_PAD)
    # tl.where, not `&`: the interpreter rejects a mask made of a block & a scalar.
    ok = tl.where((pos >= 0) & (pos < max_pos), offs_d < HALF, False)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=ok, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token * stride_qt, stride_qh, cos, sin, num_heads,
                  HALF, HEADS_PAD, HALF_PAD)  # fmt: skip
    _rotate_heads(k_ptr, token * stride_kt, stride_kh, cos, sin, num_kv_heads,
                  HALF, KV_HEADS_PAD, HALF_PAD)  # fmt: skip


def rotary(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> None:
    """Rotate q and k in place by their tokens' positions; called once per layer per step."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=dev)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64,), device=dev)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    head_dim = q.shape[2]
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_dim("k", k, 0, q.shape[0], "q's number of tokens")
    check_dim("k", k, 2, head_dim, "q's head_dim")
    check_dim("positions", positions, 0, q.shape[0], "q's number of tokens")
    check_dim("cos_sin_cache", cos_sin_cache, 1, head_dim, "head_dim")
    if q.shape[0] == 0:
        return
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache,
        q.shape[1], k.shape[1], cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=head_dim // 2, HEADS_PAD=next_pow2(q.shape[1]), KV_HEADS_PAD=next_pow2(k.shape[1]),
        HALF_PAD=next_pow2(head_dim // 2),
    )  # fmt: skip
