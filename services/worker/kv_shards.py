"""Which KV-head slices a decode rank reads from which prefill ranks (docs/design/
disaggregation.md, "Tensor parallelism"), and the `KvPool` both sides' bytes go through.

A tensor-parallel rank holds the KV heads [rank * H / N, (rank + 1) * H / N) of every block (H
the model's KV heads, N the group's size: services/worker/sharding.py splits them evenly and
contiguously). A decode rank of an equal-sized group reads its shard whole from the prefill rank
of its number; of another size it re-shards: it reads from each prefill rank whose heads overlap
its own only the overlap (`KvRead.head_start`/`num_heads`) and writes each slice at its place
among its heads. That needs H divisible by the prefill side's size, which holds between two
engines of one model (each checked its own at start); otherwise the pull is refused
(`kv_tp_mismatch`) and the request recomputed. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol


@dataclass(frozen=True, slots=True)
class ShardRead:
    """One read of a pull: from `endpoint` (a prefill rank), its heads [head_start, head_start
    + num_heads) (None: all of its shard, same-sized groups), written at this rank's heads from
    `dest_head_start` on."""

    endpoint: str
    head_start: Optional[int] = None
    num_heads: Optional[int] = None
    dest_head_start: int = 0


def shard_reads(
    kv_endpoint: str, rank: int, world_size: int, num_kv_heads: Optional[int]
) -> Optional[list[ShardRead]]:
    """What decode rank `rank` of `world_size` (holding `num_kv_heads` KV heads, None: not
    known) reads of a prefill worker whose ranks serve at `kv_endpoint` (space-separated, rank
    order: kv_ranks.py); None when its shards cannot be re-sharded into ours."""
    endpoints = kv_endpoint.split()
    if len(endpoints) == world_size:
        return [ShardRead(endpoints[rank])]
    total = num_kv_heads * world_size if num_kv_heads is not None else 0
    if not endpoints or not can_reshard(total, len(endpoints), world_size):
        return None
    assert num_kv_heads is not None  # total > 0
    per_source = total // len(endpoints)
    low, high = rank * num_kv_heads, (rank + 1) * num_kv_heads
    reads = []
    for source in range(low // per_source, (high - 1) // per_source + 1):
        start, end = max(low, source * per_source), min(high, (source + 1) * per_source)
        offset = source * per_source
        reads.append(ShardRead(endpoints[source], start - offset, end - start, start - low))
    return reads


def can_reshard(num_kv_heads: int, prefill_size: int, decode_size: int) -> bool:
    """Whether a model's `num_kv_heads` KV heads split evenly over both groups (each rank's a
    contiguous range), so that any decode rank's heads can be read from the prefill ranks."""
    if prefill_size < 1 or decode_size < 1 or num_kv_heads < 1:
        return False
    return num_kv_heads % prefill_size == 0 and num_kv_heads % decode_size == 0


@dataclass(frozen=True, slots=True)
class KvExport:
    """Leased blocks ready to send: the payload frame (a buffer, sent without a copy) and the
    layout its KvReadReply announces."""

    shape: list[int]
    dtype: str
    payload: Any


class KvLayoutError(ValueError):
    """A pulled payload whose shape or dtype is not the puller's pool's."""


class KvPool(Protocol):
    """Where a worker's KV blocks are read for a lease and written by a pull; called by
    KvTransfer between steps, on blocks no plan writes meanwhile."""

    @property
    def num_kv_heads(self) -> Optional[int]:
        """This rank's KV heads (None: the pool has no heads to slice, the simulated one)."""
        ...

    def export(self, block_ids: list[int], heads: Optional[tuple[int, int]] = None) -> KvExport:
        """These blocks' KV; only the heads [start, end) of this rank's when `heads` is given
        (checked by the caller against `num_kv_heads`)."""
        ...

    def load(
        self, block_ids: list[int], shape: list[int], dtype: str, payload: Any, head_start: int = 0
    ) -> int:
        """Write `payload` into `block_ids` (at this rank's heads from `head_start` on, as many
        as the payload holds); its bytes. Raises KvLayoutError."""
        ...

    def landing_seconds(self, num_blocks: int, shape: Optional[list[int]] = None) -> float:
        """How long after `load` (of a reply announcing `shape`) the blocks count as written:
        0 where `load` writes them (the real pool); the modelled wire and scatter time on the
        simulated link."""
        ...
