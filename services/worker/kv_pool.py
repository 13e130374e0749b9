"""The real worker's side of a KV hand-over's bytes (services/worker/kv_transfer.py moves them):
the leased blocks gathered out of the KV pool, and a pulled payload scattered into it.

The simulated worker has its own (services/worker/sim/kv_link.py): same frames, modelled time.
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.kv_cache import KVCache
from services.worker.kv_transfer import KvExport, KvLayoutError


class TensorKvPool:
    """The `KvPool` of a worker with a torch KV cache. Called between steps only."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def export(self, block_ids: list[int]) -> KvExport:
        """These blocks' K and V as one buffer of their own, [L, 2, n, bs, H, row]."""
        data = self._cache.gather(block_ids)
        payload = data.reshape(-1).view(torch.uint8).cpu().numpy()
        return KvExport(list(data.shape), _dtype_name(data.dtype), payload)

    def load(self, block_ids: list[int], shape: list[int], dtype: str, payload: Any) -> int:
        """Write a pulled payload into `block_ids`; its bytes. Raises KvLayoutError when the
        payload's layout is not this pool's."""
        expected = self._cache.blocks_shape(len(block_ids))
        torch_dtype = getattr(torch, dtype, None)
        if tuple(shape) != expected or torch_dtype != self._cache.dtype:
            raise KvLayoutError(
                f"got {shape} {dtype}, expected {list(expected)} {self._cache.dtype}"
            )
        data = torch.frombuffer(payload, dtype=torch_dtype).view(expected)
        self._cache.scatter(block_ids, data)
        return data.numel() * data.element_size()

    def landing_seconds(self, num_blocks: int) -> float:
        """0: `load` has written the blocks by the time it returns."""
        return 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
