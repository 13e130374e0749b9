"""Launchers reject bad arguments with a clear ValueError before any kernel runs.

A kernel given a wrong shape, dtype or stride would read the wrong memory (and under the
interpreter an out-of-bounds load kills the process), so these checks are the only guard.
"""

from __future__ import annotations

import pytest
import torch

from bench.kernel_inputs import PagedBatch, make_paged_batch, rope_cos_sin_cache
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary
from kernels.silu_and_mul import silu_and_mul
from kernels.write_kv import write_kv


@pytest.fixture
def batch(gen: torch.Generator) -> PagedBatch:
    return make_paged_batch(
        [1, 4], [9, 0], num_kv_heads=2, group=2, head_dim=64, block_size=16,
        dtype=torch.float32, generator=gen,
    )  # fmt: skip


def test_attention_rejects_bad_arguments(batch: PagedBatch) -> None:
    q, k, v, qsl, lens, tables = batch.attention_args()
    with pytest.raises(ValueError, match="query_start_loc must have dtype"):
        paged_attention(q, k, v, qsl.long(), lens, tables, 0.125)
    with pytest.raises(ValueError, match=r"query_start_loc.shape\[0\] must equal"):
        paged_attention(q, k, v, qsl[:-1], lens, tables, 0.125)
    with pytest.raises(ValueError, match="dtypes must match"):
        paged_attention(q.half(), k, v, qsl, lens, tables, 0.125)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(q[:, :3], k, v, qsl, lens, tables, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :32], k, v, qsl, lens, tables, 0.125)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, qsl, lens,
                        tables, 0.125)  # fmt: skip
    with pytest.raises(ValueError, match="tile_n must be a power of two"):
        paged_attention(q, k, v, qsl, lens, tables, 0.125, tile_n=48)
    with pytest.raises(ValueError, match="out must have shape"):
        paged_attention(q, k, v, qsl, lens, tables, 0.125, out=torch.empty(1, 4, 64))


def test_write_kv_rejects_bad_arguments(batch: PagedBatch) -> None:
    key = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        write_kv(key, key, batch.k_cache, batch.v_cache, batch.slot_mapping.int())
    with pytest.raises(ValueError, match=r"slot_mapping.shape\[0\] must equal"):
        write_kv(key, key, batch.k_cache, batch.v_cache, batch.slot_mapping[:3])
    with pytest.raises(ValueError, match=r"key.shape\[1\] must equal"):
        write_kv(torch.randn(5, 3, 64), torch.randn(5, 3, 64), batch.k_cache, batch.v_cache,
                 batch.slot_mapping)  # fmt: skip


def test_small_kernels_reject_bad_arguments() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] must equal"):
        rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual must have dtype"):
        rms_norm(x, torch.ones(64), 1e-5, x.half())
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, torch.ones(64), 0.0)
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.randn(4, 7))
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="positions must have dtype"):
        rotary(q, k, torch.zeros(3, dtype=torch.int32), rope_cos_sin_cache(8, 64))
    with pytest.raises(ValueError, match=r"cos_sin_cache.shape\[1\] must equal head_dim"):
        rotary(q, k, torch.zeros(3, dtype=torch.int64), rope_cos_sin_cache(8, 32))
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        silu_and_mul([[1.0, 2.0]])  # type: ignore[arg-type]
