"""What every service's receive loop shares: bounded receive turns, a per-message boundary,
peer liveness (ZMTP heartbeats, socket events, silence), drain, and socket set-up with CURVE.

A loop that serves several sockets takes at most `max_messages` (and at most `max_turn_s` of
work) from one socket per turn, so that no peer starves the others or the loop's housekeeping
(heartbeats that keep the process from being declared gone).

Each message is handled inside `guarded`: whatever a handler raises is logged with its
traceback and turned into the caller's error reply (or a logged drop), and the loop goes on.
No input may take a process down; a bug caught here is answered `internal_error`, which the
fuzz tests count as a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.curve import make_curve_server

MAX_MESSAGES_PER_TURN = 512
MAX_TURN_S = 0.1

T = TypeVar("T")
R = TypeVar("R")


def one_turn(
    sock: zmq.Socket,
    max_messages: int = MAX_MESSAGES_PER_TURN,
    max_turn_s: float = MAX_TURN_S,
    copy: bool = True,
) -> Iterator[list[Any]]:
    """The messages waiting on `sock` that one turn handles: at most `max_messages`, and none
    started after `max_turn_s` of work. Never blocks. `copy=False` yields zmq.Frame parts
    (which also tell the connection a message came on: `frame.get(zmq.SRCFD)`)."""
    deadline = time.monotonic() + max_turn_s
    for _ in range(max_messages):
        if time.monotonic() > deadline or not sock.poll(0, zmq.POLLIN):
            return
        try:
            parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        yield parts


def guarded(
    log: Any,
    event: str,
    handle: Callable[[T], R],
    message: T,
    on_error: Optional[Callable[[Exception], None]] = None,
) -> Optional[R]:
    """`handle(message)`'s result; on any exception log `event` with the traceback, call
    `on_error(exc)` (itself guarded) and return None. Called once per received message."""
    try:
        return handle(message)
    except Exception as exc:  # noqa: BLE001 - the boundary: no message may end the loop
        log.exception(event, error=type(exc).__name__)
        if on_error is not None:
            try:
                on_error(exc)
            except Exception:  # noqa: BLE001 - the error reply itself failed: logged drop
                log.exception(event + "_reply_failed")
        return None


class DisconnectWatch:
    """Peer liveness from the socket itself: `on_gone()` runs when a connection of `sock`
    drops (a peer process that dies closes it at once; a hung one needs a heartbeat instead).
    Create before `sock` connects; register `.monitor` in the loop's poller."""

    def __init__(self, sock: zmq.Socket, on_gone: Callable[[], None]) -> None:
        self._sock = sock
        self._on_gone = on_gone
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def on_events(self) -> None:
        """Called when `.monitor` is readable."""
        while self.monitor.poll(0, zmq.POLLIN):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._on_gone()

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(0)


# ---- peer liveness ---------------------------------------------------------------------------
#
# Two kinds, both needed. A peer process that dies closes its connections at once; one that hangs
# as a whole is found by ZeroMQ's own heartbeats (ZMTP PING/PONG, answered by libzmq's I/O thread
# without the GIL, so a worker busy in a long forward pass stays "alive"): set on both ends of a
# link with `set_heartbeat`, its loss seen in the socket's monitor events (`LinkEvents`). Peers
# that speak the protocol's own hellos (frontends) are watched by silence instead (`PeerClock`).

HEARTBEAT_IVL_MS = 1000  # ping the peer every second...
HEARTBEAT_TIMEOUT_MS = 3000  # ...and drop the connection after 3 s without any traffic

# What a bound socket's monitor watches for lost peers. A peer whose handshake fails (with CURVE:
# a refused key; without: garbage) gets a HANDSHAKE_FAILED_* event and then, from the same I/O
# thread, its DISCONNECTED: that disconnect is no lost peer. Any other disconnect is.
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
PEER_LINK_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS


def set_heartbeat(sock: zmq.Socket) -> None:
    """Enable ZMTP heartbeats on a socket (both ends of a link call this, before connect/bind)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class LinkEvents:
    """A bound socket's monitor read in order (events of PEER_LINK_EVENTS): `counts_as_lost` is
    True for a disconnect that is not a failed handshake's."""

    def __init__(self) -> None:
        self._num_failed = 0  # handshakes failed whose disconnect has not been seen yet

    def counts_as_lost(self, event: int) -> bool:
        if event & HANDSHAKE_FAILED_EVENTS:
            self._num_failed += 1
            return False
        if event != zmq.EVENT_DISCONNECTED:
            return False
        if self._num_failed:
            self._num_failed -= 1
            return False
        return True


class PeerClock:
    """When each peer was last heard (monotonic). A peer is watched from its first `heard`
    until it is `forget`-ten; `silent(now)` names the ones quiet for more than `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[bytes, float] = {}

    def heard(self, ident: bytes, now: float) -> None:
        self._last[ident] = now

    def __contains__(self, ident: object) -> bool:
        return ident in self._last

    def __len__(self) -> int:
        return len(self._last)

    def peers(self) -> list[bytes]:
        return list(self._last)

    def forget(self, ident: bytes) -> None:
        self._last.pop(ident, None)

    def silent(self, now: float) -> list[bytes]:
        return [i for i, seen in self._last.items() if now - seen > self.timeout_s]


# ---- drain -----------------------------------------------------------------------------------


class Drain:
    """SIGTERM's graceful stop: `request()` (safe from a signal handler: it only sets a flag),
    then the loop calls `due(now, num_live)` from its housekeeping; it starts the grace period
    once (logged) and says True when the process should finish: nothing is live any more, or
    `timeout_s` has passed."""

    def __init__(self, timeout_s: float, log: Any) -> None:
        self.timeout_s = timeout_s
        self._log = log
        self.requested = False
        self.since: Optional[float] = None  # monotonic; set by the first `due` after request

    def request(self) -> None:
        self.requested = True

    @property
    def draining(self) -> bool:
        return self.since is not None

    def due(self, now: float, num_live: int) -> bool:
        if self.requested and self.since is None:
            self.since = now
            self._log.info("draining", num_live=num_live, grace_s=self.timeout_s)
        if self.since is None:
            return False
        return num_live == 0 or now - self.since > self.timeout_s


# ---- socket set-up ---------------------------------------------------------------------------


def router_socket(
    ctx: zmq.Context,
    log: Any,
    *,
    curve_keys: Optional[Path] = None,
    heartbeat: bool = False,
    max_msg_bytes: Optional[int] = None,
    send_hwm: Optional[int] = None,
    zap_domain: Optional[str] = None,
) -> zmq.Socket:
    """A ROUTER for a service to bind, set up: undeliverable replies raise (the peer is gone),
    a bounded linger, optional frame cap / send high-water mark / ZMTP heartbeats. With
    `curve_keys` it is a CURVE server with that folder's key pair; its context needs a running
    authenticator (shared/curve.py `start_authenticator`), else every peer is admitted;
    `zap_domain` picks the authenticator's folder of admitted keys for this socket. Create a
    monitor (if any) before binding, so no event is missed. Raises ValueError on bad key files
    (the socket is closed)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 500)
    if max_msg_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if send_hwm is not None:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
    if heartbeat:
        set_heartbeat(sock)
    try:
        make_curve_server(sock, curve_keys, log, zap_domain)
    except ValueError:
        sock.close(0)
        raise
    return sock
