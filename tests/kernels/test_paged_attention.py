"""Unified paged attention under the Triton interpreter equals its torch reference.

Batches are ragged and mixed: decodes with long contexts, a prefill chunk on top of cached
context, a fresh prompt and a chunk starting exactly on a block boundary. The output is
poisoned with NaN first, so an unwritten element fails. Error bounds: kernel_inputs.TOLERANCES.
Runtime: ~35 s of CPU for the whole file (minutes of wall time on a busy shared machine).
"""

from __future__ import annotations

import importlib
import math
import random
from typing import Any

import pytest
import torch

from bench.kernel_inputs import make_paged_batch, max_violation
from kernels.paged_attention import paged_attention, paged_attention_ref

# (new tokens this step, tokens already cached) per sequence.
MIXED = ([1, 13, 20, 1, 5], [37, 40, 0, 80, 32])
DECODES = ([1, 1, 1], [95, 3, 60])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_and_compare(
    gen: torch.Generator,
    seqs: tuple[list[int], list[int]],
    *,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int = 2,
    **launch: Any,
) -> None:
    batch = make_paged_batch(
        *seqs,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=gen,
    )
    scale = 1.0 / math.sqrt(head_dim)
    inputs = [t.clone() for t in batch.attention_args()]
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention(*batch.attention_args(), scale, out=out, **launch)
    expected = paged_attention_ref(*batch.attention_args(), scale)
    assert result is out
    assert all(torch.equal(a, b) for a, b in zip(inputs, batch.attention_args(), strict=True))
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements never written"
    assert max_violation(out, expected) <= 0, (
        f"max |diff| {float((out.float() - expected.float()).abs().max()):.3g} beyond bounds"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(
    gen: torch.Generator, block_size: int, head_dim: int, group: int, dtype: torch.dtype
) -> None:
    run_and_compare(gen, MIXED, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize(
    ("block_size", "tile_n"),
    [(32, 16), (16, 64), (16, 16)],
    ids=["tile-inside-block", "tile-spans-blocks", "tile-equals-block"],
)
def test_kv_tiles_independent_of_block_size(
    gen: torch.Generator, block_size: int, tile_n: int
) -> None:
    # Several tiles per sequence: the online softmax rescales across tiles.
    run_and_compare(
        gen, MIXED, group=3, head_dim=64, block_size=block_size, dtype=torch.float32,
        tile_n=tile_n,
    )  # fmt: skip


@pytest.mark.parametrize(("group", "block_m"), [(8, 16), (3, 16), (1, 4)])
def test_short_query_blocks_split_prefill_chunks(
    gen: torch.Generator, group: int, block_m: int
) -> None:
    # block_m // group query tokens per program (2, 5 and 4 here): a chunk spans several
    # programs, each with its own causal key range, and 16 // 3 leaves a padding row.
    run_and_compare(
        gen, MIXED, group=group, head_dim=64, block_size=16, dtype=torch.float16,
        block_m=block_m, tile_n=32,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("seqs", "num_splits"),
    [(DECODES, 2), (DECODES, 7), (MIXED, 3)],
    ids=["decodes-2", "decodes-7", "mixed-3"],
)
def test_split_kv_matches_reference(
    gen: torch.Generator, seqs: tuple[list[int], list[int]], num_splits: int
) -> None:
    # With 16-token tiles some splits of the short sequences get no tile at all; they must
    # contribute nothing to the merge.
    run_and_compare(
        gen, seqs, group=3, head_dim=64, block_size=16, dtype=torch.float32,
        num_kv_heads=1, num_splits=num_splits, tile_n=16,
    )  # fmt: skip


def test_split_kv_low_precision(gen: torch.Generator) -> None:
    run_and_compare(
        gen, DECODES, group=3, head_dim=128, block_size=32, dtype=torch.bfloat16,
        num_splits=4, tile_n=32,
    )  # fmt: skip


def test_single_token_and_single_sequence(gen: torch.Generator) -> None:
    # The smallest step: one fresh token (it attends only to itself).
    run_and_compare(gen, ([1], [0]), group=1, head_dim=64, block_size=16, dtype=torch.float32)


def test_prefill_only_batch(gen: torch.Generator) -> None:
    run_and_compare(
        gen, ([17, 33, 2], [0, 0, 0]), group=3, head_dim=64, block_size=16, dtype=torch.float16
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations(gen: torch.Generator, seed: int) -> None:
    # Random ragged batches and launch shapes, to catch interactions the grids above miss.
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 6)
    q_lens = [rng.choice([1, 1, rng.randint(2, 24)]) for _ in range(num_seqs)]
    context_lens = [rng.randint(0, 90) for _ in range(num_seqs)]
    group = rng.choice([1, 3, 8])
    run_and_compare(
        gen, (q_lens, context_lens), group=group, head_dim=64,
        block_size=rng.choice([16, 32]), dtype=rng.choice(DTYPES),
        num_kv_heads=rng.choice([1, 2]), tile_n=rng.choice([16, 32, 64, 128]),
        block_m=rng.choice([16, 32, 64]), num_splits=rng.choice([1, 1, 2, 5]),
    )  # fmt: skip


def test_native_precision_path(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU fp16/bf16 tiles go to tl.dot without the fp32 upcast, and the softmax weights are
    # rounded to fp16 before the second product. Force that path here in fp16, which the
    # interpreter computes correctly (its bf16 arithmetic is not).
    # the module, not the function kernels/__init__.py re-exports under the same name
    module = importlib.import_module("kernels.paged_attention")
    monkeypatch.setattr(module, "needs_fp32_compute", lambda t: t.dtype == torch.float32)
    # (small: numpy has no fast fp16 matmul)
    run_and_compare(
        gen, ([1, 9, 1], [20, 12, 40]), group=3, head_dim=64, block_size=16,
        dtype=torch.float16, num_kv_heads=1, tile_n=32, num_splits=2,
    )  # fmt: skip
