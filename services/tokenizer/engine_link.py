"""The frontend's link to one engine: a DEALER to its scheduler, and what it last said.

An engine (one scheduler and its worker ranks) is known by its index in the frontend's
`--scheduler-addr` list: engine "0", "1", ... in logs, `health`, `stats` and /metrics. The link
says whether the engine is ready (its last EngineReady, not followed by EngineNotReady or a
loss) and when it was last heard; the request flow (request_flow.py) decides what a loss
means for requests.

Liveness: a scheduler that dies closes the connection (DisconnectWatch: found at once); a hung
one is found by silence (no message for `scheduler_timeout_s`; it answers each FrontendHello,
sent every heartbeat, so a live one is never silent that long). The DEALER reconnects by
itself: a scheduler that comes back answers the next hello with EngineReady and the engine
rejoins the rotation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import zmq

from shared.curve import make_frontend_curve_client
from shared.protocol.codec import encode
from shared.protocol.engine_channel import EngineReady, FrontendHello
from shared.transport import DisconnectWatch, guarded

# Why an engine is not ready: no handshake yet, its worker went away after one, its scheduler
# was lost (closed the connection, said EngineShutdown, or fell silent), or it is drained for
# maintenance (`conveyor drain`).
DRAINING = "draining"
NOT_READY_REASONS = ("waiting_for_worker", "worker_lost", "scheduler_unreachable", DRAINING)


class EngineLink:
    """Create, `connect()`, register `socket` and `watch.monitor` in the loop's poller.

    Owns the engine's readiness and liveness; the frontend changes them only through
    `heard`, `mark_ready`, `mark_not_ready` and `mark_lost`. Invariant: ready (an EngineReady
    held) implies it was ever ready, and a not-ready engine has one of NOT_READY_REASONS."""

    def __init__(
        self,
        index: int,
        address: str,
        frontend_id: str,
        identity: str,
        context: zmq.Context,
        on_gone: Callable[[int], None],
        curve_keys: Optional[Path] = None,
    ) -> None:
        """`frontend_id`: the configured id (said in each hello); `identity`: this process's
        socket identity (the id and a suffix of its own: a restarted frontend is a new peer)."""
        self.index = index
        self.name = str(index)  # the `engine` field of logs and labels
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        # CURVE with the frontend key pair (the scheduler admits authorized_frontends/)
        make_frontend_curve_client(self.socket, curve_keys)
        self.socket.setsockopt(zmq.IDENTITY, identity.encode())
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for an absent scheduler
        self.socket.setsockopt(zmq.LINGER, 1000)
        self._frontend_id = frontend_id
        self.watch = DisconnectWatch(self.socket, lambda: on_gone(index))
        self._ready: Optional[EngineReady] = None  # set while the engine takes requests
        self._ever_ready = False
        self._not_ready_reason = "waiting_for_worker"
        self._last_rx: float = 0.0  # time.monotonic() of its last message
        self._last_hello = float("-inf")

    @property
    def ready(self) -> Optional[EngineReady]:
        """The engine's last handshake while it takes requests, else None."""
        return self._ready

    @property
    def not_ready_reason(self) -> str:
        """Why it is not ready (meaningful while `ready` is None)."""
        return self._not_ready_reason

    def connect(self, now: float) -> None:
        """Called once at `open()`; the DEALER reconnects by itself from then on."""
        self._last_rx = now  # the silence time-out counts from here
        self.socket.connect(self.address)

    def send(self, frame: bytes) -> bool:
        """False when the scheduler is not connected (IMMEDIATE) or its queue is full."""
        try:
            self.socket.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN
            return False
        return True

    def heard(self, now: float) -> None:
        """Called on every message from the scheduler: the silence time-out restarts."""
        self._last_rx = now

    def mark_ready(self, msg: EngineReady) -> bool:
        """Called on EngineReady: the engine takes requests. True when it did not before."""
        was_ready = self._ready is not None
        self._ready, self._ever_ready = msg, True
        return not was_ready

    def mark_not_ready(self, reason: str) -> bool:
        """Called on EngineNotReady: its worker is not there, or (`reason` DRAINING) it is
        drained. True when that changed its state."""
        before = (self._ready is not None, self._not_ready_reason)
        self._ready = None
        if reason == DRAINING:
            self._not_ready_reason = DRAINING
        else:
            self._not_ready_reason = "worker_lost" if self._ever_ready else "waiting_for_worker"
        return before != (False, self._not_ready_reason)

    @property
    def draining(self) -> bool:
        """True while the engine is drained for maintenance (until it says ready again)."""
        return self._ready is None and self._not_ready_reason == DRAINING

    def mark_lost(self, reason: str) -> None:
        """Called when the scheduler is lost: out of rotation until it says EngineReady."""
        self._ready = None
        self._not_ready_reason = reason

    def hello(self, now: float, heartbeat_s: float) -> None:
        """The heartbeat: at most one FrontendHello per `heartbeat_s`."""
        if now - self._last_hello >= heartbeat_s:
            self._last_hello = now
            self.send(encode(FrontendHello(self._frontend_id)))

    def on_monitor(self, log: Any) -> None:
        """`watch.monitor` is readable: a disconnect calls `on_gone(index)`."""
        guarded(log, "monitor_event_failed", lambda _: self.watch.on_events(), 0)

    def silent_for(self, now: float) -> float:
        """Seconds since the scheduler's last message (the housekeeping's liveness check)."""
        return now - self._last_rx

    def health(self, load: int, kv_usage: float) -> dict[str, Any]:
        """This engine in the `health` reply (docs/protocol.md)."""
        return {
            "engine": self.name,
            "address": self.address,
            "ready": self._ready is not None,
            "reason": None if self._ready is not None else self._not_ready_reason,
            "load": load,
            "kv_usage": kv_usage,
            # colocated, prefill or decode (docs/design/disaggregation.md); None until ready
            "role": self._ready.role if self._ready is not None else None,
        }

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the link's state is inconsistent."""
        assert self._ready is None or self._ever_ready, f"engine {self.name}: ready, never ready"
        assert self._not_ready_reason in NOT_READY_REASONS, self._not_ready_reason
        assert self.name == str(self.index)

    def close(self) -> None:
        """Called once when the loop ends."""
        self.watch.close()
        self.socket.close()
