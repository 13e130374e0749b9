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

import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import msgpack
import zmq

from shared.client.resume import DEFAULT_MAX_RESUMES, OpenRequests, pin_seed
from shared.client.types import (
    Chunk,
    Completion,
    Done,
    Embedding,
    EngineError,
    chunk_from_wire,
    completion_from_done,
    done_from_wire,
    embedding_from_reply,
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
DEFAULT_RESUME_TIMEOUT_S = 30.0  # trying frontends after the one in use was lost
STREAM_KINDS = ("chunk", "done", "error")  # what a stream reads
ABORT_KINDS = ("aborted",)


class ClientCore:
    """Frames out, replies in, per request id. `timeout` / `connect_timeout` are the client's
    settings (validated here; the transports apply them). `server_key` (the server's public
    `.key` file) and `client_key` (this client's `.key_secret` file) switch CURVE on: both or
    neither, loaded here so that a bad path fails when the client is built."""

    def __init__(
        self,
        address: Union[str, Sequence[str]],
        timeout: float,
        connect_timeout: float,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_key: Optional[Union[str, Path]] = None,
        client_key: Optional[Union[str, Path]] = None,
        resume_timeout: float = DEFAULT_RESUME_TIMEOUT_S,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0 or resume_timeout < 0:
            raise ValueError("timeout and connect_timeout must be > 0, resume_timeout >= 0")
        self.addresses = [address] if isinstance(address, str) else list(address)
        if not self.addresses or not all(self.addresses):
            raise ValueError("give at least one frontend address")
        self._address_index = 0
        # how long a client whose frontend was lost tries the frontends (the same one, as it
        # restarts, or the next) before its open requests fail (0: never resume)
        self.resume_timeout = resume_timeout
        self.server_key = Path(server_key) if server_key is not None else None
        self.client_key = Path(client_key) if client_key is not None else None
        check_client_keys(self.server_key, self.client_key)
        # Larger requests are refused here, never sent: a frame over the frontend's hard cap
        # would drop this whole connection with every request on it (docs/protocol.md).
        self.max_frame_bytes = max_frame_bytes
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self._boxes: dict[str, deque[dict[str, Any]]] = {}  # ids being waited for
        self._abandoned: set[str] = set()  # given up: drop their replies until `aborted`
        self.open_requests = OpenRequests(max_frame_bytes)  # what a new connection resends

    @property
    def address(self) -> str:
        """The frontend this client talks to now."""
        return self.addresses[self._address_index]

    def next_address(self) -> str:
        """The frontend to try after the current one was lost (the same one when it is the
        only one: it may be restarting)."""
        self._address_index = (self._address_index + 1) % len(self.addresses)
        return self.address

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
        if self.resume_timeout > 0:
            params = pin_seed(params)
        fields = request_fields(prompt, messages, prompt_token_ids, stream, priority, params)
        return rid, generate_frame(rid, fields, self.max_frame_bytes)

    def embed(
        self,
        prompt: Optional[str],
        prompt_token_ids: Optional[list[int]] = None,
        pooling: str = "last",
        priority: int = 0,
        request_id: Optional[str] = None,
        traceparent: Optional[str] = None,
    ) -> tuple[str, bytes]:
        """(request id, `embed` frame); the id is made up when not given."""
        rid = request_id or uuid.uuid4().hex
        fields = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "pooling": pooling,
                  "priority": priority, "traceparent": traceparent}  # fmt: skip
        return rid, encode_client_message("embed", rid, **fields)

    def query(self, kind: str, **fields: Any) -> tuple[str, bytes]:
        """(query id, frame) of a `health`, `stats`, ... query; its box is open."""
        qid = f"{kind}-{uuid.uuid4().hex}"
        frame = encode_client_message(kind, qid, **fields)
        self.open(qid, frame)
        return qid, frame

    def abort(self, request_id: str) -> tuple[bool, bytes]:
        """(whether this call opened the box, `abort` frame). A live stream of the same id keeps
        its box (and still gets its final `done`); the `aborted` reply lands there too."""
        opened = request_id not in self._boxes
        self._abandoned.discard(request_id)  # its `aborted` now answers this call
        self._boxes.setdefault(request_id, deque())
        frame = encode_client_message("abort", request_id)
        self.open_requests.aborting(request_id, frame)
        return opened, frame

    def open(self, rid: str, frame: Optional[bytes] = None) -> None:
        """Collect replies for `rid` from now on (call before its first frame is sent);
        `frame`, a generate or a query, is sent again on a new connection."""
        self._boxes[rid] = deque()
        if frame is not None:
            wire = msgpack.unpackb(frame, raw=False)
            fields = {k: v for k, v in wire.items() if k not in ("type", "v", "id")}
            is_generate = wire.get("type") == "generate"
            self.open_requests.opened(rid, fields if is_generate else None, frame)

    def forget(self, rid: str) -> None:
        """Stop collecting for `rid` (it ended, or its first frame was never sent)."""
        self._boxes.pop(rid, None)
        self.open_requests.closed(rid)
        self.open_requests.forget_abort(rid)

    def abandon(self, rid: str) -> Optional[bytes]:
        """Give `rid` up without waiting: returns the `abort` frame to send (fire and forget),
        or None when `rid` was not open. Call `abort_unsent` if that send fails."""
        self.open_requests.closed(rid)
        if self._boxes.pop(rid, None) is None:
            return None
        self._abandoned.add(rid)
        return encode_client_message("abort", rid)

    def resume_frames(self) -> list[tuple[str, bytes]]:
        """Called when a new connection replaced a lost one: (id, frame) of every open request
        to send on it (streams with `resume`); those resumed too often get an `error` reply
        (`engine_unreachable`) in their box. Aborts sent before are moot there."""
        self._abandoned.clear()
        frames, exhausted = self.open_requests.resume_frames(time.monotonic(), self.resume_timeout)
        for rid in exhausted:
            self.fail(rid, f"the frontend was lost {DEFAULT_MAX_RESUMES + 1} times")
        return frames

    def retry_frames(self) -> list[tuple[str, bytes]]:
        """(id, frame) of the resumed requests to send again now: the new frontend answered
        `not_ready` (it had not heard its engines yet); `open_requests.retrying()` says
        whether any waits."""
        return self.open_requests.due_frames(time.monotonic())

    def fail(self, rid: str, message: str) -> None:
        """`rid` ends with `engine_unreachable` (its frontend is gone and none took it)."""
        self.open_requests.closed(rid)
        box = self._boxes.get(rid)
        if box is not None:
            box.append({"type": "error", "id": rid, "code": ErrorCode.ENGINE_UNREACHABLE,
                        "message": message})  # fmt: skip

    def open_ids(self) -> list[str]:
        """Ids whose replies are awaited."""
        return list(self._boxes)

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
        if not self.open_requests.on_reply(rid, msg, time.monotonic()):
            return None  # a resumed request the new frontend is not ready for: sent again
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
    def embedding(msg: dict[str, Any]) -> Embedding:
        """An `embed`'s last reply; EngineError on `error` (or a `done`: it was aborted)."""
        return embedding_from_reply(msg)

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
