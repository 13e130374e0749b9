"""The frontend's open KV hand-overs (docs/design/disaggregation.md): which prefill engine
leases the KV of which request, until the frontend releases it.

A prefill engine's request ends "handover" with its first token and a lease; the request then
resumes on a decode engine (resumption.py) carrying the lease's reference. The lease is
released (`ReleaseLease` to the prefill engine) on the first of: the decode engine says
HandoverDone (it holds the KV, or gave up and recomputes), the request closes (any end), or
the request moves on again (its decode engine was lost). While open, a lease is renewed every
heartbeat (`RenewLeases`); the prefill engine's lease time-out frees what a vanished frontend
never releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.tokenizer.engines import Engines
from shared.protocol.engine_channel import ReleaseLease, RenewLeases
from shared.protocol.kv_channel import KvHandover


@dataclass(frozen=True, slots=True)
class _Open:
    engine: int  # the prefill engine holding the lease
    lease_id: int
    generation: int


class Handovers:
    """Owns the open leases, keyed by the rid of the attempt that carries them. Invariant:
    at most one open lease per attempt rid; a released one is forgotten at once."""

    def __init__(self, engines: Engines, log: Any, heartbeat_s: float) -> None:
        self._engines = engines
        self._log = log
        self._heartbeat_s = heartbeat_s
        self._renewed_at = float("-inf")
        self._open: dict[str, _Open] = {}
        self.num_handovers = 0
        self.num_pulled = 0

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, rid: str, engine: int, ref: KvHandover) -> None:
        """Attempt `rid` was sent to a decode engine with `ref`, leased by `engine`."""
        self.release(rid)
        self._open[rid] = _Open(engine, ref.lease_id, ref.generation)
        self.num_handovers += 1

    def release(self, rid: str) -> None:
        """Attempt `rid`'s lease (if any) is over: its prefill engine frees the blocks."""
        lease = self._open.pop(rid, None)
        if lease is None:
            return
        self._engines.send(lease.engine, ReleaseLease(lease.lease_id, lease.generation))

    def release_now(self, engine: int, ref: KvHandover) -> None:
        """A hand-over nobody will take (its request ended or moved): release it at once."""
        self._engines.send(engine, ReleaseLease(ref.lease_id, ref.generation))

    def renew(self, now: float) -> None:
        """The heartbeat (at most once per `heartbeat_s`): each prefill engine hears which of
        its leases are still open, so a pull that waits behind a long step keeps its KV."""
        if not self._open or now - self._renewed_at < self._heartbeat_s:
            return
        self._renewed_at = now
        by_engine: dict[int, list[int]] = {}
        for lease in self._open.values():
            by_engine.setdefault(lease.engine, []).append(lease.lease_id)
        for engine, lease_ids in by_engine.items():
            self._engines.send(engine, RenewLeases(lease_ids))

    def done(self, rid: str, ok: bool) -> None:
        """The decode engine's HandoverDone for attempt `rid`."""
        self.num_pulled += ok
        self.release(rid)
