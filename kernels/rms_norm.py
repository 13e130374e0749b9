"""RMSNorm with the residual add fused in.

`residual_out = x + residual` (or `x` when there is no residual), rounded to x's dtype as an
unfused add would be; `out = weight * (residual_out / sqrt(mean(residual_out^2) + eps))`, the
normalized row computed in fp32 and rounded to x's dtype before the weight multiplies it, as
HF Llama does (so bf16 results match it bit for bit). Fusing saves the decoder layer one read
and one write of the hidden state per norm.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_dim, check_out, check_tensor, next_pow2


def rms_norm_ref(
    x: torch.Tensor,  # [T, Hd]
    weight: torch.Tensor,  # [Hd]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [T, Hd]
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [T, Hd], residual_out [T, Hd]), x's dtype
    """Plain-torch reference."""
    residual_out = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    r = residual_out.float()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype), residual_out


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row; the whole row fits one tile (hidden sizes are a few thousand).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    r = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum as an unfused add would, and normalize what is handed on.
        r_stored = r.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, r_stored, mask=mask)
        r = r_stored.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (r * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, Hd]
    weight: torch.Tensor,  # [Hd]
    eps: float,
    residual: Optional[torch.Tensor] = None,  # [T, Hd]
    *,
    out: Optional[torch.Tensor] = None,  # [T, Hd]
    residual_out: Optional[torch.Tensor] = None,  # [T, Hd], only with a residual
) -> tuple[torch.Tensor, torch.Tensor]:  # (out, residual_out)
    """Normalize each row of `x + residual`; called before attention and before the MLP.

    Returns new tensors (or the given `out` / `residual_out`, written in full); `residual_out`
    is `x` itself when `residual` is None.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_dim("weight", weight, 0, x.shape[1], "x's hidden size")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    out = torch.empty_like(x) if out is None else out
    check_out("out", out, x, tuple(x.shape))
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out is only written when a residual is given")
        residual_out = x
    elif residual_out is None:
        residual_out = torch.empty_like(x)
    check_out("residual_out", residual_out, x, tuple(x.shape))
    if x.shape[0] == 0:
        return out, residual_out
    res = x if residual is None else residual  # placeholder pointer when there is none
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, residual_out,
        x.shape[1], eps,
        x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(x.shape[1]),
    )  # fmt: skip
    return out, residual_out
