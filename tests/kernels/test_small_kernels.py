"""KV write, RMSNorm, rotary and SiLU-and-mul under the Triton interpreter equal their references.

Inputs are fresh random tensors, often views (slices of a fused projection, strided rows) as
the model passes them; outputs are poisoned with NaN first. Bounds: kernel_inputs.TOLERANCES.
"""

from __future__ import annotations

import pytest
import torch

from bench.kernel_inputs import make_paged_batch, max_violation, rope_cos_sin_cache
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from kernels.write_kv import write_kv, write_kv_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), f"{int(actual.isnan().sum())} elements never written"
    diff = float((actual.float() - expected.float()).abs().max())
    assert max_violation(actual, expected) <= 0, f"max |diff| {diff:.3g} beyond bounds"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 128)])
def test_write_kv_fills_exactly_the_mapped_slots(
    gen: torch.Generator, block_size: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_paged_batch(
        [1, 13, 20, 1], [37, 40, 0, 80], num_kv_heads=2, group=1, head_dim=head_dim,
        block_size=block_size, dtype=dtype, generator=gen,
    )  # fmt: skip
    num_tokens = batch.slot_mapping.shape[0]
    # K and V as slices of one fused projection output, as the model passes them.
    kv = randn(gen, num_tokens, 2 * 2 * head_dim, dtype=dtype)
    key = kv[:, : 2 * head_dim].view(num_tokens, 2, head_dim)
    value = kv[:, 2 * head_dim :].view(num_tokens, 2, head_dim)
    k_cache = torch.full_like(batch.k_cache, float("nan"))
    v_cache = torch.full_like(batch.v_cache, float("nan"))
    write_kv(key, value, k_cache, v_cache, batch.slot_mapping)

    k_flat, v_flat = k_cache.view(-1, 2, head_dim), v_cache.view(-1, 2, head_dim)
    assert torch.equal(k_flat[batch.slot_mapping], key)
    assert torch.equal(v_flat[batch.slot_mapping], value)
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool)
    untouched[batch.slot_mapping] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all()

    k_ref, v_ref = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    write_kv_ref(key, value, k_ref, v_ref, batch.slot_mapping)
    assert torch.equal(k_ref.view(-1, 2, head_dim)[batch.slot_mapping], key)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_rms_norm_matches_reference(
    gen: torch.Generator, hidden: int, dtype: torch.dtype, with_residual: bool
) -> None:
    x = randn(gen, 7, hidden + 32, dtype=dtype)[:, :hidden]  # strided rows
    residual = randn(gen, 7, hidden, dtype=dtype) if with_residual else None
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan")) if with_residual else None
    got, got_res = rms_norm(x, weight, 1e-5, residual, out=out, residual_out=res_out)
    want, want_res = rms_norm_ref(x, weight, 1e-5, residual)
    assert got is out
    assert_close(got, want)
    if with_residual:
        assert got_res is res_out
        assert_close(got_res, want_res)
    else:
        assert got_res is x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(64, 6, 2), (128, 8, 1)])
def test_rotary_in_place_matches_reference(
    gen: torch.Generator, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    num_tokens, q_size, kv_size = 9, num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(gen, num_tokens, q_size + 2 * kv_size, dtype=dtype)
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    cache = rope_cos_sin_cache(256, head_dim)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = t[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        return q, k

    expected = qkv.clone()
    rotary(*split(qkv), positions, cache)
    rotary_ref(*split(expected), positions, cache)
    assert_close(qkv, expected)  # q and k rotated alike, v (the tail) untouched
    assert torch.equal(qkv[:, q_size + kv_size :], expected[:, q_size + kv_size :])


def test_rotary_position_zero_is_identity(gen: torch.Generator) -> None:
    q, k = randn(gen, 3, 4, 64, dtype=torch.float32), randn(gen, 3, 2, 64, dtype=torch.float32)
    q0, k0 = q.clone(), k.clone()
    rotary(q, k, torch.zeros(3, dtype=torch.int64), rope_cos_sin_cache(8, 64))
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [80, 1536])  # 1536 > one 1024-wide column block
def test_silu_and_mul_matches_reference(
    gen: torch.Generator, dtype: torch.dtype, inter: int
) -> None:
    x = 3.0 * randn(gen, 5, 2 * inter, dtype=dtype)
    out = torch.full((5, inter), float("nan"), dtype=dtype)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x))
