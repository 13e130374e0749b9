"""The KV hand-over of a real worker, tensor-parallel or not (docs/design/disaggregation.md,
"Tensor parallelism"): every rank holds its own KV-head shard of every block, so every rank
has its own `KvTransfer` over its own pool. On a prefill worker each rank serves its shard at
an address of its own (`rank_bind_address`), and the ranks' endpoints, gathered once at start
over the tensor-parallel group, go to the scheduler as one space-separated `kv_endpoint` in
rank order; on a decode worker rank r pulls its shard from rank r of that list, or, when the
list has another length, re-shards: reads the slices of its KV heads from the prefill ranks
holding them (kv_shards.py; refused, the request recomputed, when the heads do not split). The
scheduler sends every rank the same GrantLease / EndLease / PullKv (one ordered socket each),
so the ranks' lease tables agree, and admits a pulled request once every rank answered its
KvPulled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import zmq

from services.worker.config import ParallelConfig
from services.worker.kv_transfer import KvTransfer
from services.worker.loop import EXIT_GROUP_LOST


def rank_bind_address(kv_addr: str, rank: int) -> str:
    """Where rank `rank` serves its shard, from the one address the launcher gives a prefill
    worker: rank 0 there; ipc `path` -> `path-r<rank>`; tcp port P -> P + rank (port 0, any
    free port, stays 0)."""
    if rank == 0:
        return kv_addr
    if kv_addr.startswith("ipc://"):
        return f"{kv_addr}-r{rank}"
    parts = urlsplit(kv_addr)
    if parts.port is None or parts.port == 0 or parts.hostname is None:
        return kv_addr
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{parts.port + rank}"


def make_kv_transfer(
    runner: Any,
    parallel: ParallelConfig,
    log: Any,
    kv_addr: Optional[str],
    curve_keys: Optional[Path],
    pull_timeout_s: float,
) -> Optional[KvTransfer]:
    """This rank's hand-over over its own KV pool; serving at its address when `kv_addr` is
    given (a prefill worker). Called once at start, by every rank in the same order: with
    several ranks it is a collective (the endpoints' gather). None, logged
    (`worker_group_lost`), when the group was lost meanwhile: the worker then exits with
    EXIT_GROUP_LOST."""
    from services.worker.kv_pool import TensorKvPool  # torch: not at import (no torch here)

    bind = rank_bind_address(kv_addr, parallel.rank) if kv_addr is not None else None
    kv = KvTransfer(
        TensorKvPool(runner.kv_cache), zmq.Context.instance(), log, bind, curve_keys,
        pull_timeout_s, rank=parallel.rank, world_size=parallel.world_size,
    )  # fmt: skip
    if parallel.world_size == 1:
        return kv
    endpoints = _gather(kv.endpoint, parallel, log)
    if endpoints is None:
        kv.close()
        return None
    kv.endpoint = " ".join(endpoints) if kv.endpoint else ""
    return kv


def _gather(endpoint: str, parallel: ParallelConfig, log: Any) -> Optional[list[str]]:
    """Every rank's endpoint, in rank order (the group's default process group); None,
    logged, when a peer is gone."""
    import torch.distributed as dist

    out: list[Any] = [None] * parallel.world_size
    try:
        dist.all_gather_object(out, endpoint)
    except RuntimeError as exc:  # gloo/nccl: a peer closed its connection or timed out
        log.error("worker_group_lost", rank=parallel.rank, exit_code=EXIT_GROUP_LOST,
                  message=f"gathering KV endpoints: {exc}")  # fmt: skip
        return None
    return [str(e) for e in out]
