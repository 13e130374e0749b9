"""TritonOps: the model's small kernels as Triton launches (the CUDA path).

Same methods and signatures as `services.worker.ops.TorchOps` (docs/design/contracts.md), each a
thin call into `kernels/`, so the model cannot tell the two apart. On CPU the kernels run only
under TRITON_INTERPRET=1, which is how the tests compare this class with TorchOps.

Unlike TorchOps, paged attention here needs no per-step plan: one launch covers the whole mixed
batch, each program finding its sequence from `query_start_loc` on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary
from kernels.silu_and_mul import silu_and_mul
from kernels.write_kv import write_kv
from services.worker.ops import rotary_then_write


class TritonOps:
    """Stateless Triton ops; every method launches one kernel (attention: one or two)."""

    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store the step's new K/V in their slots; called once per layer before attention."""
        if key.dtype != k_cache.dtype and k_cache.is_floating_point():  # as TorchOps casts
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) D], q and k rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # q [T, H, D], a view of qkv
        """rotary, then write_kv, on the views of a layer's fused qkv (two kernels)."""
        return rotary_then_write(
            self, qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    def native_layer(
        self, input_norm: torch.Tensor, post_norm: torch.Tensor, linears: Sequence[Any]
    ) -> None:
        """No whole-layer kernel: the model runs its Python layer over these ops."""
        return None

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,  # [B+1] int32
        seq_lens: torch.Tensor,  # [B] int32, context after this step
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of every query over its sequence's cached K/V (this step's
        included, so write_kv must run first)."""
        return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, Hd]
        weight: torch.Tensor,  # [Hd]
        eps: float,
        residual: Optional[torch.Tensor] = None,  # [T, Hd]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (out, residual_out = x + residual)
        return rms_norm(x, weight, eps, residual)

    def rotary(
        self,
        q: torch.Tensor,  # [T, H, D], rotated in place
        k: torch.Tensor,  # [T, Hkv, D], rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D] = [cos(D/2) | sin(D/2)]
    ) -> None:
        rotary(q, k, positions, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        return silu_and_mul(x)
