"""The quantized-weight and compact-KV CPU kernels equal their torch references.

* GGUF blocks decode to exactly the numbers the gguf package's dequantizer gives (the native
  path reads the same fp32 weights as the dequantized one).
* kernels/csrc/qlinear.cpp against `quant_linear_ref` (dequantize, then F.linear in fp32) for
  Q4_0/Q4_1/Q8_0, fp32 and bf16 activations, row counts on both sides of its two schedules
  (registers up to one register block of rows, 8 with AVX-512 and 6 without; a dequantized panel
  above) and a last tile narrower than the others; a row's output is the same bits whichever
  schedule computes it (a decode computes the same numbers with or without drafts beside it),
  and whatever the thread count (threads take runs of tiles from a shared counter).
  Bound: the products and their fp32 sums are the same, only the order differs, so the error is
  a few ulps of sum |x| |w| (bf16: one rounding of the output on top).
* Paged attention over a bf16/fp16 KV cache with fp32 queries equals the fp32 reference on the
  widened cache (the kernel widens exactly; fp32 tolerance).
* Shards of block weights (rows, block columns, padding) dequantize to the shards of the
  dequantized weight; launchers refuse bad shapes with ValueError.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch

from bench.kernel_inputs import make_paged_batch, max_violation
from kernels.cpu_ext import cpu_paged_attention, load_cpu_ops
from kernels.paged_attention import paged_attention_ref
from kernels.quant import (
    FORMATS,
    QuantWeight,
    cat_rows,
    pack,
    quant_linear,
    quant_linear_ref,
    quantize,
)
from services.worker.ops_cpu import ext_cache_dir
from services.worker.sharding import Shard


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return load_cpu_ops(ext_cache_dir())


def weights(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    # an outlier column and a block of small weights, as real checkpoints have
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, 3] *= 20.0
    w[: n // 2, 32:64] *= 1e-3
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_decode_to_the_gguf_dequantized_numbers(fmt: str, gen: torch.Generator) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    w = weights(gen, 24, 96).numpy()
    qtype = getattr(GGMLQuantizationType, fmt.upper())
    raw = gguf_quantize(w, qtype)
    expected = dequantize(raw, qtype).reshape(24, 96).astype(np.float32)
    ours = quantize(torch.from_numpy(w), fmt).dequantize().numpy()
    assert np.array_equal(ours, expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 9, 19])
@pytest.mark.parametrize("n", [40, 96])  # 40: the last tile is partly padding
def test_qlinear_matches_reference(
    ext: ModuleType, gen: torch.Generator, fmt: str, dtype: torch.dtype, rows: int, n: int
) -> None:
    k = 96
    qw = quantize(weights(gen, n, k), fmt)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    got = quant_linear(ext, x, pack(qw, int(ext.qlinear_tile())))
    want = quant_linear_ref(x, qw)
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = x.float().abs() @ qw.dequantize().abs().t()  # sum |x| |w| per output
    bound = 1e-6 * scale + (scale.abs() + 1e-3) * (2.0**-7 if dtype == torch.bfloat16 else 0.0)
    excess = (got.float() - want.float()).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_output_is_the_same_bits_under_either_schedule(
    ext: ModuleType, gen: torch.Generator, fmt: str
) -> None:
    qw = quantize(weights(gen, 40, 96), fmt)
    packed = pack(qw, int(ext.qlinear_tile()))
    x = torch.randn(19, 96, generator=gen)
    whole = quant_linear(ext, x, packed)  # 19 rows: the panel schedule
    for rows in range(1, 9):  # registers up to a block, the panel past it
        assert torch.equal(quant_linear(ext, x[:rows], packed), whole[:rows]), rows


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tile_is_computed_once_whatever_the_thread_count(
    ext: ModuleType, gen: torch.Generator, fmt: str
) -> None:
    """Threads take runs of tiles from a shared counter: 38 tiles (the last one partly padding)
    under 1, 2 and 3 threads give the same bits, and the reference's numbers."""
    tile = int(ext.qlinear_tile())
    qw = quantize(weights(gen, 37 * tile + 8, 64), fmt)
    packed = pack(qw, tile)
    before = torch.get_num_threads()
    for rows in (1, 9):  # both schedules
        x = torch.randn(rows, 64, generator=gen)
        outs = []
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(quant_linear(ext, x, packed))
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), rows
        scale = x.abs() @ qw.dequantize().abs().t()
        assert float(((outs[0] - quant_linear_ref(x, qw)).abs() - 1e-6 * scale).max()) <= 0


def test_qlinear_launcher_refuses_bad_inputs(ext: ModuleType, gen: torch.Generator) -> None:
    qw = quantize(weights(gen, 40, 64), "q4_1")
    packed = pack(qw, int(ext.qlinear_tile()))
    with pytest.raises(ValueError, match="features"):
        quant_linear(ext, torch.randn(2, 96), packed)
    with pytest.raises(ValueError, match="dtype"):
        quant_linear(ext, torch.randn(2, 64).half(), packed)
    with pytest.raises(ValueError):  # the C++ checks: codes of another size
        ext.qlinear(torch.randn(2, 64), packed.qs[:-1], packed.d, packed.m, 40, 1)  # q4_1
    with pytest.raises(ValueError, match="float16"):  # scales as the file holds them
        ext.qlinear(torch.randn(2, 64), packed.qs, packed.d.float(), packed.m, 40, 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(QuantWeight("q8_0", qw.codes[:, :40].to(torch.int8), qw.d, None), 16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_of_blocks_are_shards_of_the_weight(fmt: str, gen: torch.Generator) -> None:
    w = quantize(weights(gen, 30, 128), fmt)
    dense = w.dequantize()
    half = Shard(1, 2)
    assert torch.equal(half.rows(w).dequantize(), dense[15:])
    assert torch.equal(half.cols(w).dequantize(), dense[:, 64:])
    padded = Shard(1, 4).vocab_rows(w)  # rows 8..15 of ceil(30 / 4) = 8 per rank
    assert torch.equal(padded.dequantize(), dense[8:16])
    last = Shard(3, 4).vocab_rows(w)  # rows 24..29, then two zero rows
    assert torch.equal(last.dequantize()[:6], dense[24:]) and not last.dequantize()[6:].any()
    assert torch.equal(cat_rows([w.rows(0, 10), w.rows(10, 30)]).dequantize(), dense)
    narrow = quantize(weights(gen, 4, 96), fmt)
    assert Shard(1, 3).cols(narrow).shape == (4, 32)  # 96 / 3 = 32 cuts at a block
    with pytest.raises(ValueError, match="multiples of 32"):
        Shard(1, 2).cols(narrow)  # 48 does not


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "seqs", [([1, 13, 1, 5], [37, 40, 300, 32]), ([64], [0])], ids=["mixed", "prefill"]
)
def test_attention_reads_a_compact_cache_exactly(
    ext: ModuleType, gen: torch.Generator, kv_dtype: torch.dtype, seqs: tuple
) -> None:
    batch = make_paged_batch(*seqs, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                             dtype=torch.float32, generator=gen)  # fmt: skip
    k, v = batch.k_cache.to(kv_dtype), batch.v_cache.to(kv_dtype)
    meta = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = cpu_paged_attention(ext, batch.q, k, v, *meta, 0.125)
    want = paged_attention_ref(batch.q, k.float(), v.float(), *meta, 0.125)
    assert got.dtype == torch.float32
    assert max_violation(got, want) <= 0


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_attention_reads_8bit_rows_as_the_torch_path_writes_them(
    ext: ModuleType, gen: torch.Generator, kind: str
) -> None:
    """TorchOps.write_kv quantizes each row with its scale; the C++ kernel widens code * scale:
    it equals the reference on the dequantized cache (fp32 tolerance), and that cache is within
    the format's rounding of the original keys and values."""
    from kernels.kv_quant import dequantize_rows, quantize_rows

    batch = make_paged_batch([1, 13, 1, 5], [37, 40, 300, 32], num_kv_heads=3, group=3,
                             head_dim=64, block_size=16, dtype=torch.float32,
                             generator=gen)  # fmt: skip
    k, v = quantize_rows(batch.k_cache, kind), quantize_rows(batch.v_cache, kind)
    assert k.shape[-1] == 68
    kd, vd = dequantize_rows(k, kind), dequantize_rows(v, kind)
    step = 2.0**-7 if kind == "int8" else 2.0**-3  # of the row's absmax, at most
    row_max = batch.k_cache.abs().amax(-1, keepdim=True)
    assert ((kd - batch.k_cache).abs() <= step * row_max).all()
    meta = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = cpu_paged_attention(ext, batch.q, k, v, *meta, 0.125)
    want = paged_attention_ref(batch.q, kd, vd, *meta, 0.125)
    assert max_violation(got, want) <= 0


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_triton_writes_and_reads_8bit_rows_as_the_torch_path(
    gen: torch.Generator, kind: str
) -> None:
    """Under the interpreter: the Triton write_kv stores the very codes and scales the torch
    write path stores, and the Triton attention over them equals the reference."""
    from kernels.kv_quant import quantize_rows
    from kernels.paged_attention import paged_attention
    from kernels.write_kv import write_kv, write_kv_ref

    batch = make_paged_batch([1, 5, 1], [20, 3, 40], num_kv_heads=3, group=3, head_dim=64,
                             block_size=16, dtype=torch.float32, generator=gen)  # fmt: skip
    k, v = quantize_rows(batch.k_cache, kind), quantize_rows(batch.v_cache, kind)
    key, value = torch.randn(2, 7, 3, 64, generator=gen)
    slots = torch.tensor([0, 5, 17, 33, 40, 41, 60])
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    write_kv(key, value, k1, v1, slots)
    write_kv_ref(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    meta = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = paged_attention(batch.q, k1, v1, *meta, 0.125)
    want = paged_attention_ref(batch.q, k1, v1, *meta, 0.125)
    assert max_violation(got, want) <= 0
