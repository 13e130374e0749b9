"""Every Triton kernel against its torch reference on the device (part of the GPU check).

The same comparisons as tests/kernels, compiled for the GPU instead of interpreted: there the
kernels feed fp16/bf16 tiles to the matrix unit and round the softmax weights to the input dtype
before the second product, so the bounds below are wider than the interpreter's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.kernel_inputs import make_paged_batch, rope_cos_sin_cache
from kernels import (
    paged_attention,
    paged_attention_ref,
    rms_norm,
    rms_norm_ref,
    rotary,
    rotary_ref,
    silu_and_mul,
    silu_and_mul_ref,
    write_kv,
    write_kv_ref,
)

# (atol, rtol) against the fp32-computed reference, on a GPU.
GPU_TOLERANCES = {
    torch.float32: (1e-4, 1e-4),  # exp2 is the hardware approximation
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
MIXED = ([1, 13, 20, 1, 5, 100], [37, 40, 0, 80, 32, 700])
DECODES = ([1] * 4, [3000, 17, 900, 2048])


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """Max |diff|, whether every element was written (no NaN) and within the dtype's bound."""
    atol, rtol = GPU_TOLERANCES[expected.dtype]
    diff = (actual.float() - expected.float()).abs()
    excess = float((diff - atol - rtol * expected.float().abs()).max())
    written = not bool(actual.isnan().any())
    return {"max_abs_diff": float(diff.max()), "ok": written and excess <= 0, "written": written}


def _attention_case(
    seqs: tuple[list[int], list[int]], group: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str, **launch: Any,
) -> dict[str, Any]:  # fmt: skip
    batch = make_paged_batch(
        *seqs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype, device=device,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*batch.attention_args(), scale, out=out, **launch)
    return compare(out, paged_attention_ref(*batch.attention_args(), scale))


def attention_cases(device: str, quick: bool) -> Iterator[tuple[str, Callable[[], dict]]]:
    """(name, check) pairs: the block size x head_dim x GQA x dtype matrix, then the paths."""
    # bf16 first: the served dtype, whose math has never run (the CPU computes in fp32)
    dtypes = [torch.float32, torch.bfloat16] if quick else [torch.bfloat16, torch.float16]
    seqs = ([1, 9, 1], [20, 12, 40]) if quick else MIXED
    for dtype in dtypes:
        for block_size in (16, 32):
            for head_dim in (64, 128):
                for group in (1, 3, 8):
                    if quick and (block_size, head_dim) not in ((16, 64), (32, 128)):
                        continue
                    name = f"attention bs{block_size} d{head_dim} g{group} {_short(dtype)}"
                    yield (
                        name,
                        lambda b=block_size, d=head_dim, g=group, t=dtype: _attention_case(
                            seqs, g, d, b, t, device
                        ),
                    )
    if quick:
        yield (
            "attention split-kv 3",
            lambda: _attention_case(
                seqs, 3, 64, 16, torch.float32, device, num_splits=3, tile_n=16
            ),
        )
        return
    for group in (1, 3, 8):
        yield (
            f"attention fp32 g{group}",
            lambda g=group: _attention_case(MIXED, g, 64, 16, torch.float32, device),
        )
    paths: list[tuple[str, tuple, dict]] = [
        ("decodes, default split", DECODES, {}),
        ("decodes, 7 splits", DECODES, {"num_splits": 7}),
        ("mixed, 4 splits", MIXED, {"num_splits": 4}),
        ("mixed, block_m 16", MIXED, {"block_m": 16}),
        ("mixed, block_m 64 tile 128", MIXED, {"block_m": 64, "tile_n": 128}),
        ("mixed, tile 16", MIXED, {"tile_n": 16}),
    ]
    for label, s, launch in paths:
        for dtype in (torch.bfloat16, torch.float16):
            yield (
                f"attention {label} {_short(dtype)}",
                lambda s=s, kw=launch, t=dtype: _attention_case(s, 4, 128, 16, t, device, **kw),
            )


def small_kernel_cases(device: str, quick: bool) -> Iterator[tuple[str, Callable[[], dict]]]:
    dtypes = [torch.float32, torch.bfloat16] if quick else list(reversed(GPU_TOLERANCES))
    hidden, inter = (64, 80) if quick else (2048, 8192)
    for dtype in dtypes:
        short = _short(dtype)
        yield f"write_kv {short}", lambda t=dtype: _write_kv_case(t, device)
        yield f"rms_norm +residual {short}", lambda t=dtype: _rms_case(t, hidden, True, device)
        yield f"rms_norm {short}", lambda t=dtype: _rms_case(t, hidden, False, device)
        yield f"rotary {short}", lambda t=dtype: _rotary_case(t, device)
        yield f"silu_and_mul {short}", lambda t=dtype: _silu_case(t, inter, device)


def _write_kv_case(dtype: torch.dtype, device: str) -> dict[str, Any]:
    batch = make_paged_batch(
        [1, 13, 20], [37, 40, 0], num_kv_heads=8, group=1, head_dim=64, block_size=16,
        dtype=dtype, device=device,
    )  # fmt: skip
    t = batch.slot_mapping.shape[0]
    key = torch.randn(t, 8, 64, device=device).to(dtype)
    value = torch.randn(t, 8, 64, device=device).to(dtype)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv(key, value, k_cache, v_cache, batch.slot_mapping)
    write_kv_ref(key, value, batch.k_cache, batch.v_cache, batch.slot_mapping)
    result = compare(torch.cat([k_cache, v_cache]), torch.cat([batch.k_cache, batch.v_cache]))
    result["ok"] = result["ok"] and result["max_abs_diff"] == 0.0  # a copy must be exact
    return result


def _rms_case(dtype: torch.dtype, hidden: int, residual: bool, device: str) -> dict[str, Any]:
    x = torch.randn(33, hidden, device=device).to(dtype)
    res = torch.randn(33, hidden, device=device).to(dtype) if residual else None
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(dtype)
    out, res_out = rms_norm(x, weight, 1e-5, res)
    want, want_res = rms_norm_ref(x, weight, 1e-5, res)
    result = compare(torch.cat([out, res_out]), torch.cat([want, want_res]))
    return result


def _rotary_case(dtype: torch.dtype, device: str) -> dict[str, Any]:
    qkv = torch.randn(40, 48 * 64, device=device).to(dtype)
    positions = torch.randint(0, 4000, (40,), device=device)
    cache = rope_cos_sin_cache(4096, 64, 500000.0, device)
    expected = qkv.clone()
    for t in (qkv, expected):
        fn = rotary if t is qkv else rotary_ref
        fn(t[:, : 32 * 64].view(40, 32, 64), t[:, 32 * 64 : 40 * 64].view(40, 8, 64),
           positions, cache)  # fmt: skip
    return compare(qkv, expected)


def _silu_case(dtype: torch.dtype, inter: int, device: str) -> dict[str, Any]:
    x = 3 * torch.randn(33, 2 * inter, device=device).to(dtype)
    return compare(silu_and_mul(x), silu_and_mul_ref(x))


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
