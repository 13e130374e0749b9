"""A self-contained Llama decoder step built from kernels/ only, with random weights.

The GPU check times one engine step of a 1B-class model with it. It mirrors the worker's forward
(services/worker/model.py) but imports nothing beyond torch and kernels/, because the check runs
on a bare CUDA machine without the service dependencies (pyzmq, msgpack, structlog, orjson).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.kernel_inputs import rope_cos_sin_cache
from kernels import paged_attention, rms_norm, rotary, silu_and_mul, write_kv


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int


# Llama-3.2-1B's shapes (tied embeddings).
LLAMA_1B = LlamaShape(2048, 8192, 16, 32, 8, 64, 128256)
TINY = LlamaShape(64, 128, 2, 4, 2, 16, 256)


@dataclass(frozen=True)
class Step:
    """One step's flat inputs (the worker builds the same from a StepPlan)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [B] int64, last row of each sequence


class RandomLlama:
    """Random weights and a paged KV cache sized for `num_blocks` blocks per layer."""

    def __init__(
        self,
        shape: LlamaShape,
        *,
        num_blocks: int,
        block_size: int,
        max_pos: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.shape, self.block_size, self.device = shape, block_size, device
        s = shape

        def mat(rows: int, cols: int) -> torch.Tensor:  # [rows, cols], unit-variance outputs
            w = torch.randn(rows, cols, dtype=dtype, device=device)
            return w.mul_(1.0 / math.sqrt(cols))

        def norm() -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(s.hidden, dtype=dtype, device=device)

        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embed = mat(s.vocab, s.hidden)  # tied LM head
        self.final_norm = norm()
        self.layers = [
            {
                "input_norm": norm(),
                "qkv": mat(q_size + 2 * kv_size, s.hidden),
                "o_proj": mat(s.hidden, q_size),
                "post_norm": norm(),
                "gate_up": mat(2 * s.intermediate, s.hidden),
                "down": mat(s.hidden, s.intermediate),
            }
            for _ in range(s.num_layers)
        ]
        cache_shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
        # Random, never zeros: attention over a zero cache would hide indexing errors.
        self.kv = [
            (
                torch.randn(cache_shape, dtype=dtype, device=device),
                torch.randn(cache_shape, dtype=dtype, device=device),
            )
            for _ in range(s.num_layers)
        ]
        self.cos_sin = rope_cos_sin_cache(max_pos, s.head_dim, 500000.0, device)
        self.scale = s.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, step: Step) -> torch.Tensor:  # logits [B, vocab] float32
        s = self.shape
        t = step.input_ids.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = self.embed[step.input_ids]  # [T, hidden]
        residual = None
        for w, (k_cache, v_cache) in zip(self.layers, self.kv, strict=True):
            h, residual = rms_norm(x, w["input_norm"], 1e-5, residual)
            qkv = F.linear(h, w["qkv"])  # [T, (H + 2 Hkv) D]
            q = qkv[:, :q_size].view(t, s.num_heads, s.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, s.num_kv_heads, s.head_dim)
            rotary(q, k, step.positions, self.cos_sin)
            write_kv(k, v, k_cache, v_cache, step.slot_mapping)
            attn = paged_attention(
                q, k_cache, v_cache, step.query_start_loc, step.seq_lens, step.block_tables,
                self.scale,
            )  # fmt: skip
            x = F.linear(attn.view(t, q_size), w["o_proj"])
            h, residual = rms_norm(x, w["post_norm"], 1e-5, residual)
            x = F.linear(silu_and_mul(F.linear(h, w["gate_up"])), w["down"])
        rows = step.logits_indices
        h, _ = rms_norm(x[rows], self.final_norm, 1e-5, residual[rows])  # type: ignore[index]
        return F.linear(h, self.embed).float()


def make_step(
    q_lens: list[int], context_lens: list[int], *, block_size: int, vocab: int, device: str
) -> tuple[Step, int]:
    """A step where sequence b has context_lens[b] cached tokens and computes q_lens[b] new
    ones; blocks are handed out in a shuffled order. Returns (step, blocks used)."""
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    per_seq = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(per_seq))
    tables = torch.zeros(len(q_lens), max(per_seq), dtype=torch.int32)
    positions, slots, used = [], [], 0
    for b, (ctx, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        own = order[used : used + per_seq[b]]
        tables[b, : per_seq[b]] = own
        used += per_seq[b]
        pos = torch.arange(ctx, ctx + q_len)
        positions.append(pos)
        slots.append(own[pos // block_size] * block_size + pos % block_size)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    step = Step(
        input_ids=torch.randint(0, vocab, (sum(q_lens),), device=device),
        positions=torch.cat(positions).to(device),
        query_start_loc=starts.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        logits_indices=(starts[1:] - 1).to(device),
    )
    return step, used
