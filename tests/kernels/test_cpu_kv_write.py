"""The C++ KV write (kernels/csrc/kv_write.cpp) equals its torch reference.

`write_kv`: K and V rows of a mixed step (strided views of a fused qkv, as the model passes
them) into their slots, for every key dtype x float cache dtype the worker makes (a compact
bf16/fp16 cache under fp32 compute): bit-equal to write_kv_ref, since both only copy or round
to nearest even. `rotary_write_kv`: rotary + write in one call on the fused qkv, against
rotary_ref + write_kv_ref (kernel_inputs.TOLERANCES: the rotation is fp32 arithmetic in both,
summed in possibly another order). A bad slot raises before anything is written.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from bench.kernel_inputs import PagedBatch, make_paged_batch, max_violation, rope_cos_sin_cache
from kernels.cpu_ext import cpu_rotary_write_kv, cpu_write_kv, load_cpu_ops
from kernels.write_kv import rotary_write_kv_ref, write_kv_ref
from services.worker.ops_cpu import ext_cache_dir

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
Q_SIZE, KV_SIZE = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
# (key dtype, cache dtype): same dtype, and the compact caches of an fp32 model
PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
]


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return load_cpu_ops(ext_cache_dir())


def step(gen: torch.Generator, cache_dtype: torch.dtype) -> PagedBatch:
    # decodes, a chunk on cached context and a fresh prompt; block size 16
    return make_paged_batch(
        [1, 13, 1, 20], [37, 40, 80, 0], num_kv_heads=NUM_KV_HEADS, group=3,
        head_dim=HEAD_DIM, block_size=16, dtype=cache_dtype, generator=gen,
    )  # fmt: skip


def fused_qkv(gen: torch.Generator, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(num_tokens, Q_SIZE + 2 * KV_SIZE, generator=gen).to(dtype)


def kv_views(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    k = qkv[:, Q_SIZE : Q_SIZE + KV_SIZE].view(t, NUM_KV_HEADS, HEAD_DIM)
    return k, qkv[:, Q_SIZE + KV_SIZE :].view(t, NUM_KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize(("dtype", "cache_dtype"), PAIRS, ids=str)
def test_write_kv_equals_reference(
    ext: ModuleType, gen: torch.Generator, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    batch = step(gen, cache_dtype)
    key, value = kv_views(fused_qkv(gen, batch.slot_mapping.shape[0], dtype))
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    cpu_write_kv(ext, key, value, k_cache, v_cache, batch.slot_mapping)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_ref(key.to(cache_dtype), value.to(cache_dtype), k_ref, v_ref, batch.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert not torch.equal(k_cache, batch.k_cache)  # it wrote something


@pytest.mark.parametrize(("dtype", "cache_dtype"), PAIRS, ids=str)
def test_rotary_write_kv_equals_reference(
    ext: ModuleType, gen: torch.Generator, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    batch = step(gen, cache_dtype)
    qkv = fused_qkv(gen, batch.slot_mapping.shape[0], dtype)
    cos_sin = rope_cos_sin_cache(256, HEAD_DIM)
    qkv_ref, k_ref, v_ref = qkv.clone(), batch.k_cache.clone(), batch.v_cache.clone()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    q = cpu_rotary_write_kv(
        ext, qkv, batch.positions, cos_sin, k_cache, v_cache, batch.slot_mapping
    )
    q_ref = rotary_write_kv_ref(qkv_ref, batch.positions, cos_sin, k_ref, v_ref, batch.slot_mapping)
    assert q.shape == (qkv.shape[0], NUM_HEADS, HEAD_DIM) and q.data_ptr() == qkv.data_ptr()
    for got, want in ((q, q_ref), (qkv, qkv_ref), (k_cache, k_ref), (v_cache, v_ref)):
        assert got.dtype == want.dtype and not got.isnan().any()
        assert max_violation(got, want) <= 0
    assert torch.equal(v_cache, v_ref)  # values are not rotated: copied exactly


def test_bad_arguments_raise_before_writing(ext: ModuleType, gen: torch.Generator) -> None:
    batch = step(gen, torch.float32)
    qkv = fused_qkv(gen, batch.slot_mapping.shape[0], torch.float32)
    cos_sin = rope_cos_sin_cache(256, HEAD_DIM)
    k_cache, v_cache, before = batch.k_cache.clone(), batch.v_cache.clone(), qkv.clone()
    bad = batch.slot_mapping.clone()
    bad[-1] = k_cache.shape[0] * k_cache.shape[1]  # one past the last slot
    with pytest.raises(ValueError, match="slot"):
        cpu_rotary_write_kv(ext, qkv, batch.positions, cos_sin, k_cache, v_cache, bad)
    with pytest.raises(ValueError, match="slot"):
        cpu_write_kv(ext, *kv_views(qkv), k_cache, v_cache, bad)
    assert torch.equal(qkv, before) and torch.equal(k_cache, batch.k_cache)
    with pytest.raises(ValueError, match="int64"):
        cpu_write_kv(ext, *kv_views(qkv), k_cache, v_cache, batch.slot_mapping.int())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        codes = torch.zeros(*k_cache.shape[:3], HEAD_DIM + 4, dtype=torch.int8)
        cpu_write_kv(ext, *kv_views(qkv), codes, codes.clone(), batch.slot_mapping)
    with pytest.raises(ValueError, match="Hkv, D"):
        cpu_write_kv(ext, *kv_views(qkv), k_cache[:, :, :2], v_cache[:, :, :2], batch.slot_mapping)
