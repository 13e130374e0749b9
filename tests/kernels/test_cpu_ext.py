"""The C++ CPU kernels (kernels/csrc/*.cpp) equal their torch references.

The extension must build on every machine of this kind (g++ present): a failed build fails
`test_extension_builds_on_this_machine` here, so the worker's logged fallback to torch can never
pass unnoticed. Batches are ragged and mixed (decodes with long contexts, chunks on top of cached
context, fresh prompts, a chunk starting on a block boundary), GQA 9/3 as SmolLM2 and 4/1, block
sizes 16 and 32, fp32 and bf16. Bounds: kernel_inputs.TOLERANCES (fp32 2e-5; bf16 1.6e-2 abs +
2.4e-2 rel: the kernel computes in fp32 and rounds once, the reference rounds the same way).
The first build takes ~30-90 s of one core; later runs import the cached build.
"""

from __future__ import annotations

import math
import shutil
from types import ModuleType

import pytest
import torch

from bench.kernel_inputs import make_paged_batch, max_violation, rope_cos_sin_cache
from kernels.cpu_ext import cpu_paged_attention, load_cpu_ops
from kernels.paged_attention import paged_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref
from kernels.silu_and_mul import silu_and_mul_ref
from services.worker.ops_cpu import ext_cache_dir

DTYPES = [torch.float32, torch.bfloat16]
# (new tokens this step, tokens already cached) per sequence
MIXED = ([1, 13, 20, 1, 5, 16], [37, 40, 0, 80, 32, 32])
DECODES = ([1, 1, 1], [95, 3, 60])
LONG_DECODE = ([1], [700])  # few work items: the key range is split and merged
PREFILL = ([100], [0])


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    # built (or found built) in the real cache, as the worker does; errors propagate
    return load_cpu_ops(ext_cache_dir())


def test_extension_builds_on_this_machine() -> None:
    """No silent fallback: where a C++ compiler exists, the extension must build and load."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.fail("no C++ compiler on PATH: machines of this kind have g++")
    module = load_cpu_ops(ext_cache_dir())
    assert hasattr(module, "paged_attention")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any()
    excess = max_violation(actual, expected)
    diff = float((actual.float() - expected.float()).abs().max())
    assert excess <= 0, f"max |diff| {diff:.3g} beyond bounds by {excess:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "seqs", [MIXED, DECODES, LONG_DECODE, PREFILL], ids=["mixed", "decodes", "long", "prefill"]
)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(3, 3), (1, 4)], ids=["gqa9/3", "gqa4/1"])
def test_paged_attention_matches_reference(
    ext: ModuleType,
    gen: torch.Generator,
    dtype: torch.dtype,
    block_size: int,
    seqs: tuple[list[int], list[int]],
    num_kv_heads: int,
    group: int,
) -> None:
    batch = make_paged_batch(
        *seqs,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        generator=gen,
    )
    scale = 1.0 / math.sqrt(64)
    inputs = [t.clone() for t in batch.attention_args()]
    out = cpu_paged_attention(ext, *batch.attention_args(), scale)
    assert all(torch.equal(a, b) for a, b in zip(inputs, batch.attention_args(), strict=True))
    assert_close(out, paged_attention_ref(*batch.attention_args(), scale))


def test_paged_attention_reads_strided_q_from_fused_qkv(
    ext: ModuleType, gen: torch.Generator
) -> None:
    """q as the model passes it: a view of the fused qkv output (row stride > H * D)."""
    batch = make_paged_batch(
        *MIXED, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32,
        generator=gen,
    )  # fmt: skip
    t = batch.q.shape[0]
    qkv = torch.randn(t, 15 * 64, generator=gen)
    q = qkv[:, : 9 * 64].view(t, 9, 64)
    args = (q, *batch.attention_args()[1:])
    assert_close(cpu_paged_attention(ext, *args, 0.125), paged_attention_ref(*args, 0.125))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].to(torch.float16)}, "dtype"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].long()}, "int32"),
        (lambda a: {**a, "query_start_loc": a["query_start_loc"][:-1]}, "query_start_loc"),
        (lambda a: {**a, "q": a["q"][:, :, :32]}, "head_dim"),
        (lambda a: {**a, "k_cache": a["k_cache"].transpose(1, 2)}, "contiguous"),
    ],
    ids=["fp16", "int64-lens", "short-qsl", "head-dim", "strided-cache"],
)
def test_paged_attention_rejects_bad_arguments(
    ext: ModuleType, gen: torch.Generator, change, message: str
) -> None:
    batch = make_paged_batch(
        *DECODES, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32,
        generator=gen,
    )  # fmt: skip
    names = ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables")
    args = change(dict(zip(names, batch.attention_args(), strict=True)))
    with pytest.raises(ValueError, match=message):
        cpu_paged_attention(ext, *(args[n] for n in names), 0.125)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_rms_norm_matches_reference(
    ext: ModuleType, gen: torch.Generator, dtype: torch.dtype, with_residual: bool
) -> None:
    x = torch.randn(7, 608, generator=gen).to(dtype)[:, :576]  # strided rows
    residual = torch.randn(7, 576, generator=gen).to(dtype) if with_residual else None
    weight = (1.0 + 0.5 * torch.randn(576, generator=gen)).to(dtype)
    got, got_res = ext.rms_norm(x, weight, 1e-5, residual)
    want, want_res = rms_norm_ref(x, weight, 1e-5, residual)
    assert_close(got, want)
    if with_residual:
        assert_close(got_res, want_res)
    else:
        assert got_res is x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_in_place_matches_reference(
    ext: ModuleType, gen: torch.Generator, dtype: torch.dtype
) -> None:
    num_tokens, q_size, kv_size = 9, 9 * 64, 3 * 64
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    cache = rope_cos_sin_cache(256, 64)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, :q_size].view(num_tokens, 9, 64)
        k = t[:, q_size : q_size + kv_size].view(num_tokens, 3, 64)
        return q, k

    expected = qkv.clone()
    ext.rotary(*split(qkv), positions, cache)
    rotary_ref(*split(expected), positions, cache)
    assert_close(qkv, expected)  # q and k rotated alike
    assert torch.equal(qkv[:, q_size + kv_size :], expected[:, q_size + kv_size :])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1536, 13])  # 13: eight-lane blocks and a scalar tail
def test_silu_and_mul_matches_reference(
    ext: ModuleType, gen: torch.Generator, dtype: torch.dtype, inter: int
) -> None:
    x = (3.0 * torch.randn(5, 2 * inter, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -20.0])  # exp's clamped range
    assert_close(ext.silu_and_mul(x), silu_and_mul_ref(x))
