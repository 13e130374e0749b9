"""Tensor parallelism: one worker rank's place in a torch.distributed group, and its collectives.

Every rank is its own `python -m services.worker` process. The ranks meet at `--dist-init
tcp://HOST:PORT` (config.ParallelConfig; rank 0 listens there; loopback by default:
torch.distributed traffic is not authenticated, so other hosts belong only on a private
network). The backend follows the device:
gloo on CPU, nccl on CUDA. Every collective has a time-out (`--dist-timeout`, at most 30 s), so
a lost rank cannot hang the others: their next collective raises, the step fails, and the rank
exits with EXIT_GROUP_LOST for its supervisor to restart the whole group.

Per step a sharded model does 2 all-reduces per layer (after o_proj and after down) plus one
for the vocab-parallel embedding, one gather of the logits to rank 0 (which samples) and one
broadcast of the sampled tokens, so that every rank ends the step holding them (with
speculation, a broadcast of rank 0's drafts before the forward too: spec_ranks.py).
A world size of 1 uses SingleRank: no process group, every collective the identity.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from services.worker.config import ParallelConfig
from services.worker.steps import FatalWorkerError


class SingleRank:
    """World size 1: the same interface as TPGroup, every collective a no-op."""

    rank = 0
    world_size = 1
    num_local_ranks = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_first(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        return x

    def broadcast_ints(self, values: Optional[list[int]], count: int) -> list[int]:
        return list(values or [])

    def close(self) -> None:
        pass


class TPGroup:
    """The torch.distributed group of one worker; created once at start, closed at exit.

    Every method is a collective: all ranks call it in the same order with the same shapes
    (the plans they run are identical, so they do). A failed collective (a peer lost or timed
    out) raises FatalWorkerError: the group cannot be used again."""

    def __init__(self, config: ParallelConfig, device: str) -> None:
        self.rank = config.rank
        self.world_size = config.world_size
        self.device = device
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        try:
            dist.init_process_group(
                backend=backend,
                init_method=config.dist_init,
                rank=config.rank,
                world_size=config.world_size,
                timeout=datetime.timedelta(seconds=config.dist_timeout),
            )
        except (RuntimeError, ValueError) as exc:  # a rank missing past the time-out, a bad port
            raise FatalWorkerError(
                f"rank {config.rank} could not join the tensor-parallel group of "
                f"{config.world_size} at {config.dist_init}: {exc}"
            ) from exc
        self.backend = backend
        hosts: list[Any] = [None] * config.world_size
        self._run(dist.all_gather_object, hosts, socket.gethostname())
        # ranks sharing this host share its cores (threads = cores // num_local_ranks)
        self.num_local_ranks = sum(h == socket.gethostname() for h in hosts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self._run(dist.all_reduce, x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Rank 0: every rank's `x` [S, n] joined on the last dim -> [S, n * world_size];
        the other ranks: None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        self._run(dist.gather, x, parts, 0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_ints(self, values: Optional[list[int]], count: int) -> list[int]:
        """Rank 0's `values` (`count` of them) on every rank."""
        t = torch.zeros(count, dtype=torch.int64, device=self.device)
        if self.rank == 0 and values:
            t.copy_(torch.tensor(values, dtype=torch.int64))
        self._run(dist.broadcast, t, 0)
        return [int(v) for v in t.tolist()]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _run(self, op: Any, *args: Any) -> None:
        try:
            op(*args)
        except RuntimeError as exc:  # gloo/nccl: a peer closed its connection or timed out
            raise FatalWorkerError(
                f"tensor-parallel group lost (rank {self.rank} of {self.world_size}): {exc}"
            ) from exc


Group = Union[SingleRank, TPGroup]


def join_group(config: ParallelConfig, device: str) -> Group:
    """SingleRank for world size 1, else join (blocks until every rank has arrived or the
    time-out passes: FatalWorkerError then; the worker exits with EXIT_GROUP_LOST)."""
    if config.world_size == 1:
        return SingleRank()
    return TPGroup(config, device)


def agree_dtype(group: Group, dtype_name: Optional[str], names: tuple[str, ...]) -> str:
    """Rank 0's dtype for every rank (a probe's `auto` decision is made once, on rank 0, and
    not per host): `dtype_name` matters only on rank 0."""
    index = names.index(dtype_name) if group.rank == 0 and dtype_name is not None else 0
    return names[group.broadcast_ints([index], 1)[0]]
