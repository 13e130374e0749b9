"""Worker <-> worker KV channel: a decode worker pulls a request's KV blocks from the prefill
worker that computed them (docs/design/disaggregation.md).

The prefill worker binds a ROUTER (`--kv-addr`); a decode worker connects a DEALER and sends
one `KvRead` per hand-over. The answer is multipart: one `KvReadReply` frame (msgpack), then,
when `ok`, one payload frame holding the blocks' K and V, sent without a copy from the buffer
the prefill worker gathered them into. A read is served only for a lease its scheduler granted
(`GrantLease` on the worker channel) with the same generation: anything else is refused and
logged, so blocks that were freed (and maybe reused) are never served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True, slots=True)
class KvHandover:
    """Where a request's prompt KV waits for its decode engine: the prefill scheduler's lease
    (`lease_id`, `generation`) over `block_ids` (its full blocks, in order: `num_tokens` =
    len(block_ids) * block_size prompt positions). `kv_endpoint`: the prefill worker's KV
    address (a tensor-parallel worker's: one per rank, space-separated, in rank order), filled
    in by the frontend from that engine's EngineReady."""

    lease_id: int
    generation: int
    block_ids: list[int]
    num_tokens: int
    block_size: int
    kv_endpoint: str = ""


@dataclass(frozen=True, slots=True)
class KvRead:
    """Decode worker -> prefill worker: send the blocks of this lease; only the KV heads
    [head_start, head_start + num_heads) of the rank's shard when given (a decode worker with
    another tensor-parallel size re-shards: services/worker/kv_shards.py), else all of them."""

    lease_id: int
    generation: int
    head_start: Optional[int] = None
    num_heads: Optional[int] = None

    def __post_init__(self) -> None:
        # checked on decode (invalid_field): a range is both fields or neither, and not empty
        start, num = self.head_start, self.num_heads
        if (start is None) != (num is None) or (start or 0) < 0 or (num is not None and num < 1):
            raise ValueError("KvRead needs head_start >= 0 and num_heads >= 1 together, or neither")


@dataclass(frozen=True, slots=True)
class KvReadReply:
    """Prefill worker -> decode worker, first frame of the answer. When `ok`, a second frame
    follows: the blocks as one contiguous buffer of `dtype` in `shape`
    [layers, 2 (K, V), blocks, block_size, kv_heads, row]."""

    ok: bool
    code: str = ""
    message: str = ""
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    # the read answered (None: a frame that was no read): a decode worker with several pulls
    # in flight on one connection matches each answer to its pull by them
    lease_id: Optional[int] = None
    generation: Optional[int] = None
