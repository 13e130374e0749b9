"""The real worker's side of a KV hand-over's bytes (services/worker/kv_transfer.py moves them):
the leased blocks gathered out of the KV pool, and a pulled payload scattered into it.

The simulated worker has its own (services/worker/sim/kv_link.py): same frames, modelled time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from services.worker.kv_cache import KVCache
from services.worker.kv_shards import KvExport, KvLayoutError


class TensorKvPool:
    """The `KvPool` of a worker with a torch KV cache. Called between steps only."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    @property
    def num_kv_heads(self) -> int:
        return self._cache.blocks_shape(1)[4]

    def export(self, block_ids: list[int], heads: Optional[tuple[int, int]] = None) -> KvExport:
        """These blocks' K and V (of the heads [start, end) when given) as one buffer of their
        own, [L, 2, n, bs, H, row]."""
        data = self._cache.gather(block_ids, heads)
        payload = data.reshape(-1).view(torch.uint8).cpu().numpy()
        return KvExport(list(data.shape), _dtype_name(data.dtype), payload)

    def load(
        self, block_ids: list[int], shape: list[int], dtype: str, payload: Any, head_start: int = 0
    ) -> int:
        """Write a pulled payload into `block_ids` (at this rank's heads from `head_start` on);
        its bytes. Raises KvLayoutError when the payload's layout is not this pool's."""
        full = self._cache.blocks_shape(len(block_ids))
        num_heads = shape[4] if len(shape) == len(full) else 0
        expected = (*full[:4], num_heads, *full[5:])
        torch_dtype = getattr(torch, dtype, None)
        fits = 0 <= head_start and 0 < num_heads and head_start + num_heads <= full[4]
        if tuple(shape) != expected or torch_dtype != self._cache.dtype or not fits:
            raise KvLayoutError(
                f"got {shape} {dtype} at head {head_start}, expected {list(full)} (or a slice of "
                f"its heads) {self._cache.dtype}"
            )
        data = torch.frombuffer(payload, dtype=torch_dtype).view(expected)
        self._cache.scatter(block_ids, data, head_start)
        return data.numel() * data.element_size()

    def landing_seconds(self, num_blocks: int, shape: Optional[list[int]] = None) -> float:
        """0: `load` has written the blocks by the time it returns."""
        return 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
