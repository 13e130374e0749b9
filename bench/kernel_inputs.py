"""Random inputs for checking kernels against their references (tests and the GPU check).

Never zeros: every tensor is drawn fresh, block tables are a random permutation of the cache's
blocks (so neighbouring positions live in far-apart blocks), and the cache holds spare blocks
that no sequence owns, filled with noise the kernels must not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Error bounds against the reference (which computes in fp32 from the same low-precision
# inputs), per dtype: (atol, rtol). fp32: reassociation only. fp16: one rounding of the output
# (2^-11 relative) with room for tile-order effects. bf16: up to three ulps (2^-7 relative
# each), because the Triton interpreter truncates fp32 -> bf16 where torch and GPUs round to
# nearest, and RMSNorm and SiLU-and-mul round twice (as HF does).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 2.4e-2),
}


@dataclass(frozen=True)
class PagedBatch:
    """One step's attention inputs: a flattened ragged batch over a paged KV cache."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, the cache slots of the new tokens
    positions: torch.Tensor  # [T] int64

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
        )


def make_paged_batch(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """Sequence b has `context_lens[b]` cached tokens and `q_lens[b]` new ones this step."""
    if len(q_lens) != len(context_lens):
        raise ValueError("q_lens and context_lens must have the same length")
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq, default=0) + extra_table_cols
    # Unused table entries point at real blocks too: a kernel reading past seq_len would see
    # noise rather than crash, and the comparison would catch it.
    tables = perm[torch.randint(0, num_blocks, (len(q_lens), width), generator=generator)]
    slots, positions, used = [], [], 0
    for b, (ctx, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        own = perm[used : used + blocks_per_seq[b]]
        tables[b, : blocks_per_seq[b]] = own
        used += blocks_per_seq[b]
        for pos in range(ctx, ctx + q_len):
            slots.append(int(own[pos // block_size]) * block_size + pos % block_size)
            positions.append(pos)
    num_tokens = sum(q_lens)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        q=rand(num_tokens, num_kv_heads * group, head_dim),
        k_cache=rand(*cache_shape),
        v_cache=rand(*cache_shape),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
    )


def rope_cos_sin_cache(
    max_pos: int, head_dim: int, theta: float = 10000.0, device: str | torch.device = "cpu"
) -> torch.Tensor:  # [max_pos, head_dim] fp32, rows [cos(D/2) | sin(D/2)]
    """The rotary table in the layout `rotary` reads."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def max_violation(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| beyond the dtype's bound (<= 0 means within bounds)."""
    atol, rtol = TOLERANCES[expected.dtype]
    diff = (actual.float() - expected.float()).abs()
    bound = atol + rtol * expected.float().abs()
    return float((diff - bound).max()) if diff.numel() else 0.0
