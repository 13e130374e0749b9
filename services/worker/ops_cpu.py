"""CpuOps: the model's small kernels as one C++ call each (kernels/csrc/*.cpp).

Same methods and signatures as TorchOps (docs/design/contracts.md), which stays the reference
and the fallback. Paged attention reads K/V in place from the block pool (no gather, no padded
copy, no mask tensor); RMSNorm fuses the residual add; rotary rotates q and k in one call,
reading cos/sin rows by position; SiLU-and-mul is one pass.

The extension is built once per machine into `$CONVEYOR_CACHE_DIR/ext/<key>` (kernels.cpu_ext):
by `conveyor model prepare`, else by the first worker start. When it cannot be built the worker
logs `cpu_ext_unavailable` once and runs TorchOps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from kernels.cpu_ext import (
    HEAD_DIMS,
    cpu_paged_attention,
    cpu_rotary_write_kv,
    cpu_write_kv,
    load_cpu_ops,
)
from services.worker.linear import BlockLinear
from services.worker.model import StepTensors
from services.worker.ops import TorchOps, rotary_then_write
from shared.env import env_str


def cache_base() -> Path:
    """$CONVEYOR_CACHE_DIR, default ~/.cache/conveyor (models/, ext/ and dtype/ below it)."""
    base = env_str("CACHE_DIR")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "conveyor"


def ext_cache_dir() -> Path:
    """$CONVEYOR_CACHE_DIR/ext: one build folder per key (kernels.cpu_ext.build_key)."""
    return cache_base() / "ext"


def try_load_cpu_ext(log: Optional[Any] = None) -> Optional[ModuleType]:
    """The built extension, or None (logged once through `log`) when it cannot be built.
    Called once per process by make_ops; `conveyor model prepare` calls it to build ahead."""
    try:
        return load_cpu_ops(ext_cache_dir())
    except Exception as exc:  # a compiler error has many types (RuntimeError, OSError, ...)
        if log is not None:
            log.warning("cpu_ext_unavailable", error=str(exc)[-2000:], fallback="torch")
        return None


def build_cpu_ext() -> Optional[str]:
    """Build (or find built) the extension ahead of the first worker start; called by
    `conveyor model prepare`. Returns None when it loads, else the error's text."""
    try:
        load_cpu_ops(ext_cache_dir())
    except Exception as exc:  # see try_load_cpu_ext
        return str(exc)[-2000:]
    return None


class CpuOps(TorchOps):
    """C++ kernels for every op the extension covers (the KV write of an 8-bit cache, with its
    per-row scales, stays torch's)."""

    name = "cpu"

    def __init__(self, ext: ModuleType) -> None:
        super().__init__()
        self._ext = ext

    @staticmethod
    def supports(head_dim: int, dtype: torch.dtype) -> bool:
        """Whether the compiled kernels cover this model (else the runner uses TorchOps)."""
        return head_dim in HEAD_DIMS and dtype in (torch.float32, torch.bfloat16)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        if not k_cache.is_floating_point():
            return super().write_kv(key, value, k_cache, v_cache, slot_mapping)
        cpu_write_kv(self._ext, key, value, k_cache, v_cache, slot_mapping)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) D], q and k rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # q [T, H, D], a view of qkv
        if not k_cache.is_floating_point():
            return rotary_then_write(
                self, qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
            )
        return cpu_rotary_write_kv(
            self._ext, qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    def native_layer(
        self, input_norm: torch.Tensor, post_norm: torch.Tensor, linears: Sequence[Any]
    ) -> Optional[Any]:
        """A layer's weights as one C++ object for `decoder_layer`, when its four linear layers
        (qkv, o, gate/up, down) are packed blocks without bias; else None (the model runs its
        Python layer). Called once per layer at load, on a single rank only."""
        if not all(isinstance(lin, BlockLinear) and lin.bias is None for lin in linears):
            return None
        ext = self._ext
        packed = [
            ext.PackedLinear(lin.packed.qs, lin.packed.d, lin.packed.m, lin.packed.n,
                             lin.format_code)
            for lin in linears
        ]  # fmt: skip
        return ext.LayerWeights(input_norm, post_norm, *packed)

    def decoder_layer(
        self,
        weights: Any,  # native_layer's object
        x: torch.Tensor,  # [T, Hd]
        residual: Optional[torch.Tensor],  # [T, Hd], None before the first layer
        eps: float,
        step: StepTensors,
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
        k_cache: torch.Tensor,  # [N, bs, Hkv, D], a float cache
        v_cache: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (output, residual), [T, Hd] each
        """The whole layer in one C++ call (kernels/csrc/decoder_layer.cpp): the same kernels in
        the same order as the model's Python layer over these ops, so the same numbers."""
        out, res = self._ext.decoder_layer(
            weights, x, residual, eps, step.positions, cos_sin_cache, k_cache, v_cache,
            step.query_start_loc, step.seq_lens, step.block_tables, step.slot_mapping, scale,
        )  # fmt: skip
        return out, res

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
        return cpu_paged_attention(
            self._ext, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale
        )

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, Hd]
        weight: torch.Tensor,  # [Hd]
        eps: float,
        residual: Optional[torch.Tensor] = None,  # [T, Hd]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, res = self._ext.rms_norm(x, weight, eps, residual)
        return out, res

    def rotary(
        self,
        q: torch.Tensor,  # [T, H, D], rotated in place
        k: torch.Tensor,  # [T, Hkv, D], rotated in place
        positions: torch.Tensor,  # [T] int64
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    ) -> None:
        self._ext.rotary(q, k, positions, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        return self._ext.silu_and_mul(x)
