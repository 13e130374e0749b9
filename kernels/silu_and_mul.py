"""SiLU-and-multiply, the gated MLP activation: `silu(x[:, :I]) * x[:, I:]`.

The gate and up projections come out of one fused matmul as `[T, 2I]`; this reads both halves
once and writes `[T, I]`. silu(gate) is rounded to x's dtype before the multiply, as an
unfused `silu(gate) * up` (HF Llama's MLP) rounds it, so low-precision results match that.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_out, check_tensor, next_pow2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x [T, 2I] -> [T, I]
    """Plain-torch reference."""
    half = x.shape[-1] // 2
    gate, up = x[:, :half].float(), x[:, half:].float()
    act = torch.nn.functional.silu(gate).to(x.dtype).float()
    return (act * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr
):  # fmt: skip
    # Grid: (rows, column blocks of BLOCK).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = act * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: Optional[torch.Tensor] = None,  # [T, I], written in full when given
) -> torch.Tensor:  # [T, I]
    """Gated activation of the MLP, called once per layer per step."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x's last dimension must be even (gate | up), got {tuple(x.shape)}")
    inter = x.shape[1] // 2
    if out is None:
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    check_out("out", out, x, (x.shape[0], inter))
    if out.numel() == 0:
        return out
    block = min(1024, next_pow2(inter))
    grid = (x.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out
