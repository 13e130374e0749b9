"""The scheduler's link to its worker rank(s): the worker socket, who is connected, what they
said, and when one is lost.

Socket: ROUTER, bound; every rank's DEALER has identity "worker-<rank>". Each rank gets every
plan; only rank 0's results count (a StepResult from any other identity is a logged drop). ZMTP
heartbeats plus the socket's monitor events (shared/transport.py) detect a lost worker; a
disconnect after a failed handshake (a refused CURVE key, garbage) is none. With `curve_keys`
the socket is a CURVE server admitting only `authorized_workers/` (the ZAP handler: see
services/scheduler/__main__.py).

The link decides nothing about requests: it hands each decoded message to the loop
(`WorkerHost`, services/scheduler/server.py) through a type -> handler table.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.scheduler.server_config import ServerConfig
from shared.curve import WORKERS_DOMAIN
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.worker_channel import (
    KvPulled,
    StepResult,
    WorkerFailure,
    WorkerReady,
    WorkerShutdown,
    worker_identity,
)
from shared.transport import PEER_LINK_EVENTS, LinkEvents, guarded, one_turn, router_socket


class WorkerHost(Protocol):
    """What the link tells the loop. Each call runs inside the receive boundary."""

    def on_workers_ready(self) -> None: ...  # a rank said WorkerReady (recorded in `ranks`)
    def on_result(self, result: StepResult, received_at: float) -> None: ...
    def on_step_failed(self, failure: WorkerFailure) -> None: ...
    def on_worker_lost(self, reason: str) -> None: ...
    def on_kv_pulled(self, msg: KvPulled) -> None: ...  # a PullKv's answer (decode engine)


class WorkerLink:
    """Owns the worker socket and the ranks that said WorkerReady since they last connected."""

    def __init__(self, ctx: zmq.Context, config: ServerConfig, host: WorkerHost, log: Any) -> None:
        self._host = host
        self.log = log
        self._num_workers = config.num_workers
        self.ranks: dict[int, WorkerReady] = {}
        # the connection (file descriptor) each rank said WorkerReady on: only the loss of one
        # of these is a lost worker, not that of any other peer (a probe, a stray client)
        self._rank_fds: dict[int, int] = {}
        self._rank_idents: dict[bytes, int] = {}  # identity -> rank, for the ranks ready
        self._events = LinkEvents()  # a refused peer's disconnect is no worker lost
        self.sock = router_socket(
            ctx, log, curve_keys=config.curve_keys, heartbeat=True, zap_domain=WORKERS_DOMAIN
        )
        self.monitor = self.sock.get_monitor_socket(PEER_LINK_EVENTS)  # before bind: no event lost
        self.sock.bind(config.worker_address)
        self._handlers: dict[type, Callable[[Any, float], None]] = {
            StepResult: host.on_result,
            WorkerFailure: lambda msg, _at: host.on_step_failed(msg),
            KvPulled: lambda msg, _at: host.on_kv_pulled(msg),
        }

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()

    # ---- state -------------------------------------------------------------------------------

    def num_ready(self) -> int:
        return len(self.ranks)

    def first(self) -> WorkerReady:
        """Rank 0's (the lowest rank's) handshake; call only with ranks ready."""
        return self.ranks[min(self.ranks)]

    def merged(self) -> WorkerReady:
        """The engine the ranks make together: rank 0's shape, the smallest KV pool."""
        small = min(self.ranks.values(), key=lambda r: r.num_blocks)
        return dataclasses.replace(self.first(), num_blocks=small.num_blocks)

    def forget_ranks(self) -> None:
        """The workers are lost: none counts as ready until it says WorkerReady again."""
        self.ranks.clear()
        self._rank_fds.clear()
        self._rank_idents.clear()

    # ---- sending -----------------------------------------------------------------------------

    def send_all(self, frame: bytes) -> bool:
        """Send one frame to every rank; a rank that is gone counts as a lost worker (False)."""
        try:
            for rank in list(self.ranks):
                self.sock.send_multipart([worker_identity(rank), frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._host.on_worker_lost(f"cannot reach the worker: {exc.strerror}")
            return False
        return True

    def restart_group(self, reason: str) -> None:
        """Tell every rank still listed to exit for a restart (WorkerShutdown(restart=True)):
        called when one rank of a tensor-parallel group is lost, since no rank may go on
        alone. Ranks already gone are skipped."""
        frame = encode(WorkerShutdown(reason, restart=True))
        for rank in list(self.ranks):
            try:
                self.sock.send_multipart([worker_identity(rank), frame], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # that one is the rank lost
        self.log.info("worker_group_restart_asked", ranks=sorted(self.ranks), reason=reason)

    # ---- receiving ---------------------------------------------------------------------------

    def on_readable(self) -> None:
        """Called when the worker socket is readable: one bounded turn of messages."""
        for parts in one_turn(self.sock, max_messages=1024, max_turn_s=1.0, copy=False):
            guarded(self.log, "worker_message_failed", self._on_parts, parts)

    def _on_parts(self, parts: list[zmq.Frame]) -> None:
        """One worker message: [identity, frame]. Called inside the boundary: a frame that
        raises, or one that is not a rank's to send, is a logged drop (with its code), and the
        loop goes on."""
        ident, frame = parts[0].bytes, parts[-1]
        received_at = time.time()  # the result -> next plan gap starts here, before decode
        try:
            msg = decode(frame.buffer)
        except DecodeError as exc:  # logged drop: a garbled frame is no verdict on a step
            self.log.error("bad_worker_frame", code=exc.code, message=exc.message, ident=ident)
            return
        if isinstance(msg, WorkerReady):
            if ident == worker_identity(msg.rank) and msg.rank < self._num_workers:
                self._on_ready(msg, frame.get(zmq.SRCFD))
            else:
                self.log.warning("worker_frame_dropped", code="unexpected_rank", ident=ident,
                                 rank=msg.rank)  # fmt: skip
            return
        rank = self._rank_idents.get(ident)  # only a rank that said WorkerReady may answer
        if rank is None or (rank != 0 and isinstance(msg, StepResult)):
            self.log.warning("worker_frame_dropped", code="unknown_identity", ident=ident,
                             type=type(msg).__name__)  # fmt: skip
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.log.warning("unexpected_worker_message", code="unexpected_type",
                             type=type(msg).__name__, ident=ident)  # fmt: skip
            return
        handler(msg, received_at)

    def _on_ready(self, ready: WorkerReady, fd: int) -> None:
        """A rank's handshake, on the connection `fd`."""
        if ready.rank in self.ranks:  # it came back without us seeing it go
            self._host.on_worker_lost(f"rank {ready.rank} said ready again")
        self.ranks[ready.rank] = ready
        self._rank_fds[ready.rank] = fd
        self._rank_idents[worker_identity(ready.rank)] = ready.rank
        self.log.info("worker_ready", **dataclasses.asdict(ready))
        self._host.on_workers_ready()

    def on_monitor(self) -> None:
        """Called when the monitor socket is readable."""
        while self.monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self.monitor)
            lost = self._events.counts_as_lost(event["event"])
            if lost and self.ranks and int(event["value"]) in self._rank_fds.values():
                self._host.on_worker_lost("worker connection lost")
            elif lost:
                self.log.info("peer_disconnected", code="not_a_rank")
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self.log.info("worker_connected")
