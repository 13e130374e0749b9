"""What every service's receive loop shares: bounded receive turns, a per-message boundary,
and peer liveness from socket events.

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
from typing import Any, Optional, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

MAX_MESSAGES_PER_TURN = 512
MAX_TURN_S = 0.1

T = TypeVar("T")
R = TypeVar("R")


def one_turn(
    sock: zmq.Socket, max_messages: int = MAX_MESSAGES_PER_TURN, max_turn_s: float = MAX_TURN_S
) -> Iterator[list[bytes]]:
    """The messages waiting on `sock` that one turn handles: at most `max_messages`, and none
    started after `max_turn_s` of work. Never blocks."""
    deadline = time.monotonic() + max_turn_s
    for _ in range(max_messages):
        if time.monotonic() > deadline or not sock.poll(0, zmq.POLLIN):
            return
        try:
            parts = sock.recv_multipart(flags=zmq.NOBLOCK)
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
