"""Paged attention compiles a small fixed set of variants, all of them at the worker's start-up.

A recorded burst (tests/data/burst_steps.json: 64 requests of the mixed workload at scale 0.5,
served by the real model on CPU, each step's token counts and lengths; bench/gpu/record_steps.py)
is replayed through the attention launcher as it shapes launches on an H200 (132 SMs), on meta
tensors built as the model builds them. Each launch's compile key is computed exactly as Triton's
JIT computes it for a CUDA sm_90 device (kernels/launch.py: Triton's own binder), rather than
compiling each variant ahead of time (~1-3 s of CPU each; bench/gpu/compile.py compiles the
bucket shapes). The keys must all be among the warm-up's (services/worker/warmup.py) and no more
than the documented bound: `len(gpu_variants())` attention variants and one merge per split
bucket above 1, per model shape, dtype and KV dtype. Runtime ~5-20 s.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from kernels.kv_quant import CODE_DTYPES, SCALE_BYTES
from kernels.launch import Launch
from kernels.paged_attention import _unified_attention_kernel, attention_launches
from kernels.paged_attention_shape import SPLIT_BUCKETS, Target, gpu_variants
from services.worker.model import split_qkv
from services.worker.warmup import attention_cases

STEPS = json.loads((Path(__file__).parents[1] / "data" / "burst_steps.json").read_text())["steps"]
H200 = Target(on_gpu=True, num_sms=132, upcast=False)
BLOCK_SIZE = 16
NUM_BLOCKS = 4096
# (query heads, KV heads, head_dim): SmolLM2-135M and Llama-3.2-1B
SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64)}
MAX_ATTENTION = len(gpu_variants())  # 6: decode x 5 split buckets, prefill unsplit
MAX_MERGE = len(SPLIT_BUCKETS) - 1  # 4


def _cache(kv_dtype: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    if kv_dtype in CODE_DTYPES:
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim + SCALE_BYTES)
        return torch.empty(shape, dtype=CODE_DTYPES[kv_dtype], device="meta")
    return torch.empty((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), dtype=dtype,
                       device="meta")  # fmt: skip


def _step_launches(
    num_tokens: list[int], seq_lens: list[int], shape: tuple[int, int, int],
    cache: torch.Tensor, dtype: torch.dtype, target: Target,
) -> list[Launch]:  # fmt: skip
    # A step's tensors as services/worker/input_batch.py and model.py build them, on meta.
    num_heads, num_kv_heads, head_dim = shape
    t, b = sum(num_tokens), len(num_tokens)
    qkv = torch.empty(t, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device="meta")
    q = split_qkv(qkv, num_heads, num_kv_heads, head_dim)[0]
    width = -(-max(seq_lens) // BLOCK_SIZE)
    i32 = dict(dtype=torch.int32, device="meta")
    return attention_launches(
        q, cache, cache, torch.empty(b + 1, **i32), torch.empty(b, **i32),  # type: ignore[arg-type]
        torch.empty(b, width, **i32), 0.125, torch.empty_like(q), target,  # type: ignore[arg-type]
    )  # fmt: skip


def _warm_keys(shape: tuple[int, int, int], cache: torch.Tensor, dtype: torch.dtype) -> set:
    keys = set()
    for c in attention_cases(*shape, dtype, BLOCK_SIZE, "meta"):
        for launch in attention_launches(
            c.q, cache, cache, c.query_start_loc, c.seq_lens, c.block_tables, 0.125,
            torch.empty_like(c.q), H200, block_m=c.block_m, num_splits=c.num_splits,
        ):  # fmt: skip
            keys.add(launch.compile_key())
    return keys


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_burst_compiles_only_warmed_variants(model: str, kv_dtype: str) -> None:
    shape, dtype = SHAPES[model], torch.bfloat16
    cache = _cache(kv_dtype, shape[1], shape[2], dtype)
    warm = _warm_keys(shape, cache, dtype)
    per_kernel = Counter(name for name, _ in warm)
    assert per_kernel["_unified_attention_kernel"] == MAX_ATTENTION, per_kernel
    assert per_kernel["_merge_splits_kernel"] == MAX_MERGE, per_kernel
    served: set = set()
    for num_tokens, seq_lens in STEPS:
        for launch in _step_launches(num_tokens, seq_lens, shape, cache, dtype, H200):
            served.add(launch.compile_key())
    assert served <= warm, f"{len(served - warm)} variants compile while serving"
    # the burst reaches both row buckets and some split (a replay that could not fail would not)
    assert len(served) >= 3, served


def test_default_specialization_would_compile_per_step() -> None:
    # The same replay with Triton's default specialization of num_seqs and the block table's
    # stride (equal to 1, a multiple of 16, other): more variants than the bound, so the
    # bound above is what `do_not_specialize` buys, not what the burst happens to reach.
    from triton.runtime.jit import JITFunction

    plain = JITFunction(_unified_attention_kernel.fn)
    shape, dtype = SHAPES["smollm2"], torch.bfloat16
    cache = _cache("bfloat16", shape[1], shape[2], dtype)
    keys = set()
    for num_tokens, seq_lens in STEPS:
        first = _step_launches(num_tokens, seq_lens, shape, cache, dtype, H200)[0]
        keys.add(Launch(plain, first.grid, first.args, first.kwargs).compile_key())
    assert len(keys) > MAX_ATTENTION, keys


def test_warm_up_cases_are_valid_launches(gen: torch.Generator) -> None:
    # The warm-up's inputs run through the kernels (here the interpreter) to the reference's
    # result: on a GPU they compile each variant without reading out of bounds.
    from kernels.paged_attention import paged_attention, paged_attention_ref

    num_heads, num_kv_heads, head_dim = SHAPES["smollm2"]
    k = torch.randn(2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    for c in attention_cases(num_heads, num_kv_heads, head_dim, torch.float32, BLOCK_SIZE, "cpu"):
        c.q.copy_(torch.randn(c.q.shape, generator=gen))
        args = (c.q, k, v, c.query_start_loc, c.seq_lens, c.block_tables, 0.125)
        got = paged_attention(*args, block_m=c.block_m, num_splits=c.num_splits)
        torch.testing.assert_close(got, paged_attention_ref(*args), atol=2e-5, rtol=2e-5)
