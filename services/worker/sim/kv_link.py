"""The KV hand-over of the simulated worker (SIMULATED: no bytes move; their time is modelled).

A simulated prefill worker serves its leases and a simulated decode worker pulls them through
the real worker's KvTransfer (services/worker/kv_transfer.py: the same ZeroMQ frames, leases,
generations, refusals and time-outs); only the pool differs. `SimKvPool` sends an empty payload
announcing the blocks' logical layout; the time the bytes would take is modelled:

    bytes     = blocks * block_size * kv_bytes_per_token          (the model's K and V, all layers)
    export_s  = 2 * bytes / kv_bandwidth                           (two-sided only: the prefill
                                                                    side gathers the blocks into
                                                                    one buffer, read + write)
    landing_s = link latency + bytes / (ranks * link bandwidth) + 2 * bytes / kv_bandwidth
                                                                   (decode side: the wire, then
                                                                    the scatter)

kv_bandwidth is the group's (N ranks: N times one device's, profiles.py), so a tensor-parallel
group gathers and scatters 1/N of the bytes per rank in parallel. The wire is per rank as well
(one NIC or NVLink port per GPU): `ranks` = min(prefill ranks, decode ranks), the busiest
side's share (TP 2 -> 2: each rank pair moves half; TP 1 -> 2: the one prefill GPU sends all;
2 -> 4: each prefill GPU sends half). The prefill side's size travels in the reply's layout.

The export waits in the prefill worker's loop thread (the gather is device work); the landing
does not hold up the decode worker: its pull is reported `landing_s` after the reply arrived
(a DMA engine's copy, beside the decode steps). The links are named (`--sim-kv-link`), with
stated bandwidths and the same ~80% achieved share the tensor-parallel model assumes
(profiles.py); assumptions, not measurements. The software cost of a hand-over (the frontend's
hop, both schedulers, the KvRead round trip) is not modelled: it runs for real in the simulated
stack.

When a read is answered (`--sim-kv-reads`): "two-sided", between the prefill worker's steps, as
the real Python worker does (a read waits for the step in progress); "one-sided", during them,
as an RDMA read from registered memory (NIXL) needs no prefill compute: the simulated prefill
worker then also takes the lease messages (`GrantLease`, `EndLease`) out of its plan stream
while a step runs (a progress thread's work on a GPU server; worker/inbox.py), and no gather is
charged. "auto" (the default) is one-sided on links with RDMA (NVLink, InfiniBand, free) and
two-sided on Ethernet (TCP). The real worker is always two-sided (docs/design/disaggregation.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from services.worker.kv_shards import KvExport, KvLayoutError
from services.worker.kv_transfer import KvTransfer
from services.worker.process_config import WorkerProcessConfig
from services.worker.sim.profiles import GB, DeviceProfile, ModelShape

KV_READS = ("auto", "one-sided", "two-sided")  # SimConfig.kv_reads
SIM_DTYPE = "sim"  # the payload's dtype: a layout only, no bytes
LINK_EFFICIENCY = 0.8  # achieved share of a link's stated rate (as NVLINK_EFFICIENCY)


@dataclass(frozen=True, slots=True)
class KvLink:
    """A link between a prefill and a decode device: bytes/s one way (None: free), latency."""

    name: str
    bandwidth: Optional[float]
    latency_s: float
    source: str
    one_sided: bool  # RDMA reads of registered memory (no prefill compute)


KV_LINKS: dict[str, KvLink] = {
    # both devices in one HGX node: NVLink 4, 450 GB/s each way (NVIDIA H100/H200 datasheets)
    "nvlink": KvLink(
        "nvlink", 450 * GB * LINK_EFFICIENCY, 10e-6, "NVLink 4, 450 GB/s each way", True
    ),
    # separate nodes, one 400 Gb/s NDR InfiniBand NIC per GPU (GPUDirect RDMA): 50 GB/s
    "infiniband": KvLink(
        "infiniband", 50 * GB * LINK_EFFICIENCY, 20e-6, "400 Gb/s NDR InfiniBand per GPU", True
    ),
    # separate nodes over 100 Gb/s Ethernet (TCP: the prefill host answers): 12.5 GB/s
    "ethernet": KvLink(
        "ethernet", 12.5 * GB * LINK_EFFICIENCY, 50e-6, "100 Gb/s Ethernet (TCP)", False
    ),
    "free": KvLink("free", None, 0.0, "no transfer cost (the engine's own overhead only)", True),
}


class SimKvPool:
    """The `KvPool` of a simulated worker: modelled export and landing times, no bytes.
    `one_sided`: reads need no gather on the prefill side (RDMA reads the blocks)."""

    def __init__(
        self,
        device: DeviceProfile,
        model: ModelShape,
        block_size: int,
        link: KvLink,
        one_sided: bool = False,
    ) -> None:
        self._device = device
        self._ranks = device.tensor_parallel_size
        self._block_bytes = block_size * model.kv_bytes_per_token
        self._layout = [block_size, model.kv_bytes_per_token]  # per block
        self._link = link
        self._one_sided = one_sided

    def num_bytes(self, num_blocks: int) -> int:
        return num_blocks * self._block_bytes

    def copy_seconds(self, num_blocks: int) -> float:
        """One device-side copy of the blocks (a gather or a scatter): read + write."""
        if self._device.zero_cost or self._device.kv_bandwidth is None:
            return 0.0
        return 2.0 * self.num_bytes(num_blocks) / self._device.kv_bandwidth

    def export_seconds(self, num_blocks: int) -> float:
        return 0.0 if self._one_sided else self.copy_seconds(num_blocks)

    def landing_seconds(self, num_blocks: int, shape: Optional[list[int]] = None) -> float:
        """Called by KvTransfer after `load` (`shape`: the reply's layout, whose last entry
        is the prefill group's size; None: a group of ours): the wire, each rank moving its
        share in parallel, and the scatter, modelled."""
        if self._device.zero_cost:
            return 0.0
        wire = 0.0
        source_ranks = shape[3] if shape is not None and len(shape) == 4 else self._ranks
        if self._link.bandwidth is not None:
            per_rank = self.num_bytes(num_blocks) / min(self._ranks, max(1, source_ranks))
            wire = self._link.latency_s + per_rank / self._link.bandwidth
        return wire + self.copy_seconds(num_blocks)

    @property
    def num_kv_heads(self) -> Optional[int]:
        """None: no heads to slice (a simulated group moves its KV as one)."""
        return None

    def export(self, block_ids: list[int], heads: Optional[tuple[int, int]] = None) -> KvExport:
        """Called by KvTransfer to serve a read: the layout, an empty payload, after the
        modelled gather."""
        _wait(self.export_seconds(len(block_ids)))
        return KvExport([len(block_ids), *self._layout, self._ranks], SIM_DTYPE, b"")

    def load(
        self, block_ids: list[int], shape: list[int], dtype: str, payload: Any, head_start: int = 0
    ) -> int:
        """Called by KvTransfer with a pulled answer: checks the layout; the modelled bytes
        (their time is `landing_seconds`)."""
        expected = [len(block_ids), *self._layout]  # then the prefill group's size
        if list(shape[:3]) != expected or len(shape) != 4 or shape[3] < 1 or dtype != SIM_DTYPE:
            raise KvLayoutError(f"got {shape} {dtype}, expected {expected} {SIM_DTYPE}")
        return self.num_bytes(len(block_ids))


def sim_kv_transfer(pool: SimKvPool, process: WorkerProcessConfig, log: Any) -> KvTransfer:
    """The simulated worker's hand-over over `pool`: pulls KV, and serves it at
    `process.kv_addr` when given (a prefill engine's worker)."""
    return KvTransfer(pool, zmq.Context.instance(), log, process.kv_addr, process.curve_keys,
                      process.kv_pull_timeout_s)  # fmt: skip


def kv_during_steps(kv: KvTransfer, one_sided: bool) -> Callable[[float], None]:
    """How a simulated step waits (until a perf_counter deadline): the replies of its pulls
    land meanwhile (ZeroMQ receives them beside the step), and, `one_sided`, the KV reads and
    lease messages that arrive are answered at once (KvTransfer.serve_until)."""

    def wait(deadline: float) -> None:
        kv.serve_until(deadline, one_sided)

    return wait


def _wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
