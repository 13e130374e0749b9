"""The frontend's client side: the ROUTER clients connect to, sends and client heartbeats.

Clients that vanish are found by ROUTER_MANDATORY: a reply or a heartbeat that cannot be routed
fails, and `on_gone(identity, reason)` runs (the request flow ends that connection's requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

import zmq

from services.tokenizer.config import FrontendConfig
from shared.curve import make_curve_server
from shared.protocol import client_channel as cc
from shared.protocol.errors import ErrorCode
from shared.transport import guarded, one_turn

CommandHandler = Callable[[bytes, cc.ClientCommand], None]


class ClientLink:
    """Call `bind()` (raises zmq.ZMQError), register `socket` in the loop's poller.

    Owns the client socket, when each connection last heard from the frontend (heartbeats)
    and the count of error replies (`stats`). `on_gone(identity, reason)` is called from
    inside `send` when a client is gone; it may send to other clients, never to this one."""

    def __init__(
        self,
        config: FrontendConfig,
        context: zmq.Context,
        log: Any,
        on_gone: Callable[[bytes, str], None],
    ) -> None:
        self.config = config
        self.log = log
        self.socket = context.socket(zmq.ROUTER)
        self._on_gone = on_gone
        self._last_tx: dict[bytes, float] = {}  # identity -> last frame sent (heartbeats)
        self._num_errors_total = 0  # error replies sent (for `stats`)

    @property
    def num_errors_total(self) -> int:
        """Error replies sent since start (client errors and failed requests)."""
        return self._num_errors_total

    def bind(self) -> None:
        """Called once by the server's `open()`. A peer that sends a frame over the hard cap
        is dropped; a reply that cannot be routed raises (the client is gone)."""
        sock, cfg = self.socket, self.config
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable reply -> error: client gone
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.hard_cap_bytes)
        sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        sock.setsockopt(zmq.LINGER, 500)
        make_curve_server(sock, cfg.curve_keys, self.log)  # ZAP: see __main__
        try:
            sock.bind(cfg.frontend_address)
        except zmq.ZMQError:
            sock.close(0)
            raise

    def serve_turn(self, on_command: CommandHandler) -> None:
        """The socket is readable: decode one turn of client messages (shared/transport.py)
        and hand each valid command to `on_command(identity, command)`; bad ones are answered
        here with their error code."""
        for parts in one_turn(self.socket):
            guarded(self.log, "client_message_failed", self._on_message, (parts, on_command),
                    lambda _exc, parts=parts: self._internal_error(parts))  # fmt: skip

    def _on_message(self, item: tuple[list[bytes], CommandHandler]) -> None:
        """One client message: a DEALER's [identity, frame]. Called inside the boundary."""
        parts, on_command = item
        ident = parts[0]
        if len(parts) != 2:
            msg = "send exactly one frame per message from a DEALER socket"
            self.reply_error(ident, ErrorCode.MALFORMED_MESSAGE, msg, None)
            return
        try:
            cmd = cc.decode_client_message(parts[1], self.config.max_frame_bytes)
        except cc.ClientMessageError as exc:
            self.reply_error(ident, exc.code, exc.message, exc.id)
            return
        on_command(ident, cmd)

    def _internal_error(self, parts: list[bytes]) -> None:
        msg = "the frontend failed on this message (logged)"
        self.reply_error(parts[0], ErrorCode.INTERNAL, msg, cc.peek_id(parts[-1]))

    def reply_error(self, ident: bytes, code: str, message: str, client_id: Optional[str]) -> None:
        """A message refused before it became a request: counted, logged, answered."""
        self._num_errors_total += 1
        self.log.info("client_error", code=code, client_id=client_id, message=message)
        self.send(ident, cc.error_reply(code, message, client_id))

    def send_error(self, ident: bytes, frame: bytes) -> bool:
        """A request's `error` reply (its caller logged why): counted, then sent."""
        self._num_errors_total += 1
        return self.send(ident, frame)

    def send(self, ident: bytes, frame: bytes) -> bool:
        """False (and `on_gone` called) when the client is gone."""
        try:
            self.socket.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: disconnected; EAGAIN: not reading at all
            self._last_tx.pop(ident, None)
            self._on_gone(ident, exc.strerror)
            return False
        self._last_tx[ident] = time.monotonic()
        return True

    def heartbeat(self, active: Iterable[bytes], now: float) -> None:
        """Any connection with a request in flight hears something at least every heartbeat_s;
        a send that fails means the client is gone."""
        active = set(active)
        self._last_tx = {i: t for i, t in self._last_tx.items() if i in active}
        for ident in active:
            if now - self._last_tx.get(ident, float("-inf")) >= self.config.heartbeat_s:
                self.send(ident, cc.heartbeat_reply())

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when a send time lies in the future (monotonic)
        or the error count went negative."""
        now = time.monotonic()
        assert self._num_errors_total >= 0
        assert all(t <= now for t in self._last_tx.values()), self._last_tx

    def close(self) -> None:
        """Called once when the loop ends."""
        self.socket.close()
