"""Argument checks shared by the kernel launchers.

A Triton kernel trusts every pointer and stride it is given: a wrong shape or dtype reads the
wrong memory (and under the interpreter an out-of-bounds load segfaults). So every launcher
checks its arguments here first and raises ValueError with the argument's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: Optional[torch.device] = None,
    unit_last_stride: bool = True,
) -> torch.Tensor:
    """Check that `t` is a tensor of rank `ndim`, one of `dtypes`, on `device`.

    With `unit_last_stride` the last dimension must be contiguous (stride 1): the kernels read
    rows as contiguous vectors. Other strides may be anything (views are allowed).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if unit_last_stride and t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise unless `t.shape[dim] == expected` (`what` names where `expected` comes from)."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(t.shape)}"
        )


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Raise unless all tensors share one dtype."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        found = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors, strict=True))
        raise ValueError(f"dtypes must match: {found}")


def needs_fp32_compute(t: torch.Tensor) -> bool:
    """Whether a kernel must upcast its tiles to fp32 before arithmetic.

    On CPU the kernels run in the Triton interpreter, whose bf16 arithmetic is wrong (copies
    and conversions are right), so everything is computed in fp32 there. On a GPU fp16/bf16
    tiles go to the matrix unit as they are, with fp32 accumulation.
    """
    return t.device.type != "cuda" or t.dtype == torch.float32


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange sizes must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def check_out(name: str, out: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check a caller-provided output buffer: `shape`, `like`'s dtype and device, row-contiguous."""
    check_tensor(name, out, ndim=len(shape), dtypes=(like.dtype,), device=like.device)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
