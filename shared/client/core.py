"""The client's protocol logic with no I/O: both Python clients are thin transports over it.

`ClientCore` builds every frame a client sends (docs/protocol.md) and routes every frame it
receives to the request it belongs to; `Client` (blocking) and `AsyncClient` (asyncio) only move
frames over their ZeroMQ socket and wait. So the two cannot drift apart on what a reply means.

Routing: each request (or query) the caller waits on has a box, opened before its first frame is
sent, that collects its replies in arrival order; the caller takes the first reply of the types
it wants (`take`), others stay (a stream and an `abort` of the same id share one box). A request
given up without waiting (`abandon`) has its late replies dropped until its `aborted` arrives.
Not thread-safe: one owner, like the socket it serves.
"""

from __future__ import annotations

import uuid
from collections import deque
from pathlib import Path
from typing import Any, Optional, Union

import zmq

from shared.client.types import (
    Chunk,
    Completion,
    Done,
    EngineError,
    chunk_from_wire,
    completion_from_done,
    done_from_wire,
    error_from_wire,
    generate_frame,
    request_fields,
)
from shared.curve import check_client_keys, make_curve_client
from shared.protocol.client_channel import (
    DEFAULT_MAX_FRAME_BYTES,
    decode_reply,
    encode_client_message,
)
from shared.protocol.codec import DecodeError
from shared.protocol.errors import ErrorCode

RESULT_KINDS = ("done", "error")  # what ends a non-streaming request
EMBED_KINDS = ("embedding", "done", "error")  # what ends an `embed` (done: it was aborted)
STREAM_KINDS = ("chunk", "done", "error")  # what a stream reads
ABORT_KINDS = ("aborted",)


class ClientCore:
    """Frames out, replies in, per request id. `timeout` / `connect_timeout` are the client's
    settings (validated here; the transports apply them). `server_key` (the server's public
    `.key` file) and `client_key` (this client's `.key_secret` file) switch CURVE on: both or
    neither, loaded here so that a bad path fails when the client is built."""

    def __init__(
        self,
        address: str,
        timeout: float,
        connect_timeout: float,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_key: Optional[Union[str, Path]] = None,
        client_key: Optional[Union[str, Path]] = None,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        self.server_key = Path(server_key) if server_key is not None else None
        self.client_key = Path(client_key) if client_key is not None else None
        check_client_keys(self.server_key, self.client_key)
        # Larger requests are refused here, never sent: a frame over the frontend's hard cap
        # would drop this whole connection with every request on it (docs/protocol.md).
        self.max_frame_bytes = max_frame_bytes
        self.address = address
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self._boxes: dict[str, deque[dict[str, Any]]] = {}  # ids being waited for
        self._abandoned: set[str] = set()  # given up: drop their replies until `aborted`

    def secure(self, sock: zmq.Socket) -> None:
        """Called by a transport on its new socket, before connect: CURVE when keys were given.
        A server that refuses the key never completes the handshake, so the socket never
        becomes writable and requests fail with `connect_error` (engine_unreachable)."""
        if self.server_key is not None and self.client_key is not None:
            make_curve_client(sock, self.server_key, self.client_key)

    # ---- frames out (each opens the box its replies go to) ------------------------------------

    def generate(
        self,
        request_id: Optional[str],
        prompt: Optional[str],
        messages: Optional[list[dict[str, Any]]],
        prompt_token_ids: Optional[list[int]],
        stream: bool,
        priority: int,
        params: dict[str, Any],
    ) -> tuple[str, bytes]:
        """(request id, `generate` frame); the id is made up when not given. EngineError when
        the request cannot be sent (frame_too_large, invalid_field: see `generate_frame`)."""
        rid = request_id or uuid.uuid4().hex
        fields = request_fields(prompt, messages, prompt_token_ids, stream, priority, params)
        return rid, generate_frame(rid, fields, self.max_frame_bytes)

    def embed(
        self,
        request_id: Optional[str],
        prompt: Optional[str],
        prompt_token_ids: Optional[list[int]],
        pooling: str,
        priority: int,
        traceparent: Optional[str] = None,
    ) -> tuple[str, bytes]:
        """(request id, `embed` frame); the id is made up when not given."""
        rid = request_id or uuid.uuid4().hex
        fields = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "pooling": pooling,
                  "priority": priority, "traceparent": traceparent}  # fmt: skip
        return rid, encode_client_message("embed", rid, **fields)

    def query(self, kind: str) -> tuple[str, bytes]:
        """(query id, frame) of a `health` or `stats` query; its box is open."""
        qid = f"{kind}-{uuid.uuid4().hex}"
        self.open(qid)
        return qid, encode_client_message(kind, qid)

    def abort(self, request_id: str) -> tuple[bool, bytes]:
        """(whether this call opened the box, `abort` frame). A live stream of the same id keeps
        its box (and still gets its final `done`); the `aborted` reply lands there too."""
        opened = request_id not in self._boxes
        self._abandoned.discard(request_id)  # its `aborted` now answers this call
        self._boxes.setdefault(request_id, deque())
        return opened, encode_client_message("abort", request_id)

    def open(self, rid: str) -> None:
        """Collect replies for `rid` from now on (call before its first frame is sent)."""
        self._boxes[rid] = deque()

    def forget(self, rid: str) -> None:
        """Stop collecting for `rid` (it ended, or its first frame was never sent)."""
        self._boxes.pop(rid, None)

    def abandon(self, rid: str) -> Optional[bytes]:
        """Give `rid` up without waiting: returns the `abort` frame to send (fire and forget),
        or None when `rid` was not open. Call `abort_unsent` if that send fails."""
        if self._boxes.pop(rid, None) is None:
            return None
        self._abandoned.add(rid)
        return encode_client_message("abort", rid)

    def abort_unsent(self, rid: str) -> None:
        """The abandon's frame could not be sent: the frontend still aborts the request when
        the connection goes, so just stop waiting for its `aborted`."""
        self._abandoned.discard(rid)

    def is_open(self, rid: str) -> bool:
        return rid in self._boxes

    # ---- frames in ----------------------------------------------------------------------------

    def receive(self, frame: bytes) -> Optional[str]:
        """Route one received frame; returns the id whose box got a reply, else None (a
        heartbeat, a late reply of an abandoned request, or a frame that is not ours)."""
        try:
            msg = decode_reply(frame)
        except DecodeError:
            return None  # not a protocol reply: ignore, as the protocol asks of unknown input
        rid = msg.get("id")
        if not isinstance(rid, str):
            return None  # heartbeat or an error about no request of ours
        if rid in self._abandoned:
            if msg["type"] == "aborted":
                self._abandoned.discard(rid)
            return None
        box = self._boxes.get(rid)
        if box is None:
            return None
        box.append(msg)
        return rid

    def take(self, rid: str, kinds: tuple[str, ...]) -> Optional[dict[str, Any]]:
        """The first collected reply for `rid` of one of `kinds` (others stay, in order)."""
        box = self._boxes.get(rid)
        if box is None:
            return None
        for i, msg in enumerate(box):
            if msg["type"] in kinds:
                del box[i]
                return msg
        return None

    # ---- replies -> results -------------------------------------------------------------------

    @staticmethod
    def completion(msg: dict[str, Any]) -> Completion:
        """A non-streaming request's last reply; raises EngineError on `error`."""
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return completion_from_done(msg)

    @staticmethod
    def query_result(msg: dict[str, Any]) -> dict[str, Any]:
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return msg

    @staticmethod
    def stream_event(msg: dict[str, Any]) -> Union[Chunk, Done]:
        """A stream's reply: a Chunk, or the Done that ends it; raises EngineError on `error`."""
        if msg["type"] == "chunk":
            return chunk_from_wire(msg)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return done_from_wire(msg)

    # ---- the errors a transport raises --------------------------------------------------------

    def closed_error(self) -> EngineError:
        return EngineError(ErrorCode.ENGINE_UNREACHABLE, "the client is closed")

    def connect_error(self) -> EngineError:
        return EngineError(
            ErrorCode.ENGINE_UNREACHABLE,
            f"cannot connect to {self.address} within {self.connect_timeout:g} s",
        )

    def silence_error(self) -> EngineError:
        return EngineError(
            ErrorCode.ENGINE_UNREACHABLE, f"no reply from {self.address} within {self.timeout:g} s"
        )
