"""The blocking Python client: one DEALER connection to a frontend (docs/protocol.md).

Several requests may be in flight on one Client (e.g. two streams iterated in turns): replies
for ids other than the one being waited for are buffered per id. A Client is not thread-safe
(ZeroMQ sockets are not); use one per thread.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any, Optional

import zmq

from shared.addresses import DEFAULT_FRONTEND_ADDR
from shared.client.types import (
    Chunk,
    Completion,
    Done,
    EngineError,
    chunk_from_wire,
    completion_from_chunks,
    completion_from_done,
    done_from_wire,
    error_from_wire,
    request_fields,
)
from shared.protocol.client_channel import decode_reply, encode_client_message
from shared.protocol.codec import DecodeError
from shared.protocol.errors import ErrorCode

DEFAULT_ADDRESS = DEFAULT_FRONTEND_ADDR  # kept: the public name of the client API


class Client:
    """`timeout`: seconds without any message from the frontend before EngineError
    (`engine_unreachable`). The frontend sends heartbeats while a request is in flight, so a
    long generation or a long queue does not hit it. `connect_timeout`: how long a request
    waits for a connection to the frontend before the same error (never longer than
    `timeout`)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float = 60.0,
        context: Optional[zmq.Context] = None,
        connect_timeout: float = 5.0,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        self.address = address
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing while not connected: a request to an absent frontend fails at once
        # (after connect_timeout) instead of waiting in a queue for the full timeout.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(address)
        self._inbox: dict[str, deque[dict[str, Any]]] = {}  # ids being waited for
        self._abandoned: set[str] = set()  # aborted by close(): drop their late replies
        self._closed = False

    # ---- requests ----------------------------------------------------------------------------

    def generate(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[list[int]] = None,
        stream: bool = False,
        priority: int = 0,
        request_id: Optional[str] = None,
        **params: Any,
    ) -> Completion:
        """Run one request to its end; raise EngineError on an `error` reply or timeout."""
        if stream:
            it = self.stream(
                prompt,
                messages=messages,
                prompt_token_ids=prompt_token_ids,
                priority=priority,
                request_id=request_id,
                **params,
            )
            chunks = list(it)
            if it.done is None:  # the iterator ends only after `done` or by raising
                raise EngineError(ErrorCode.INTERNAL, "stream ended without `done`")
            return completion_from_chunks(it.done, chunks)
        rid = self._send_generate(
            request_id, prompt, messages, prompt_token_ids, False, priority, params
        )
        try:
            msg = self._next_for(rid, ("done", "error"))
        except EngineError:
            self._abandon(rid)  # timed out: don't leave it running
            raise
        self._inbox.pop(rid, None)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return completion_from_done(msg)

    def stream(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[list[int]] = None,
        priority: int = 0,
        request_id: Optional[str] = None,
        **params: Any,
    ) -> Stream:
        """Start a streaming request; iterate the result for Chunks. Closing the iterator (or
        dropping it) before the end aborts the request in the engine."""
        rid = self._send_generate(
            request_id, prompt, messages, prompt_token_ids, True, priority, params
        )
        return Stream(self, rid)

    def abort(self, request_id: str) -> bool:
        """Abort a request; True when it was in flight. Idempotent.

        A stream of that id still receives its final `done` (finish_reason "abort")."""
        owned = request_id not in self._inbox  # else a live stream of ours shares the box
        self._abandoned.discard(request_id)  # its `aborted` now answers this call
        self._inbox.setdefault(request_id, deque())
        try:
            self._send(encode_client_message("abort", request_id))
            msg = self._next_for(request_id, ("aborted",))
        finally:
            if owned:
                self._inbox.pop(request_id, None)
        return bool(msg.get("found"))

    def health(self) -> dict[str, Any]:
        """The `health` reply: `ready`, `reason`, `model`, `max_model_len`, `vocab_size`, ..."""
        return self._query("health")

    def stats(self) -> dict[str, Any]:
        """The `stats` reply: `ready`, `frontend` and `engine` counters."""
        return self._query("stats")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------

    def _query(self, kind: str) -> dict[str, Any]:
        qid = f"{kind}-{uuid.uuid4().hex}"
        self._inbox[qid] = deque()
        try:
            self._send(encode_client_message(kind, qid))
            msg = self._next_for(qid, (kind, "error"))
        finally:
            self._inbox.pop(qid, None)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return msg

    def _send_generate(
        self,
        request_id: Optional[str],
        prompt: Optional[str],
        messages: Optional[list[dict[str, Any]]],
        prompt_token_ids: Optional[list[int]],
        stream: bool,
        priority: int,
        params: dict[str, Any],
    ) -> str:
        rid = request_id or uuid.uuid4().hex
        fields = request_fields(prompt, messages, prompt_token_ids, stream, priority, params)
        self._inbox[rid] = deque()
        try:
            self._send(encode_client_message("generate", rid, **fields))
        except EngineError:
            self._inbox.pop(rid, None)  # never sent: nothing to abort
            raise
        return rid

    def _send(self, frame: bytes) -> None:
        if self._closed:
            raise EngineError(ErrorCode.ENGINE_UNREACHABLE, "the client is closed")
        if not self._sock.poll(int(self.connect_timeout * 1000), zmq.POLLOUT):
            raise EngineError(
                ErrorCode.ENGINE_UNREACHABLE,
                f"cannot connect to {self.address} within {self.connect_timeout:g} s",
            )
        self._sock.send(frame)

    def _next_for(self, rid: str, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The first buffered or new reply for `rid` whose type is one of `kinds` (others stay
        buffered, in order); replies for other ids are buffered on the way."""
        box = self._inbox[rid]
        last_rx = time.monotonic()
        while True:
            for i, msg in enumerate(box):
                if msg["type"] in kinds:
                    del box[i]
                    return msg
            wait = last_rx + self.timeout - time.monotonic()
            if wait <= 0:
                raise EngineError(
                    ErrorCode.ENGINE_UNREACHABLE,
                    f"no reply from {self.address} within {self.timeout:g} s",
                )
            if not self._sock.poll(int(wait * 1000) + 1, zmq.POLLIN):
                continue
            last_rx = time.monotonic()
            self._dispatch(self._sock.recv())

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = decode_reply(frame)
        except DecodeError:
            return  # not a protocol reply: ignore, as the protocol asks of unknown input
        rid = msg.get("id")
        if not isinstance(rid, str):
            return  # heartbeat or an error about no request of ours
        if rid in self._abandoned:
            if msg["type"] == "aborted":
                self._abandoned.discard(rid)
            return
        box = self._inbox.get(rid)
        if box is not None:
            box.append(msg)

    def _abandon(self, rid: str) -> None:
        """Abort without waiting (a stream closed early); its late replies are dropped."""
        self._inbox.pop(rid, None)
        if self._closed:
            return
        self._abandoned.add(rid)
        try:
            self._sock.send(encode_client_message("abort", rid), zmq.NOBLOCK)
        except zmq.ZMQError:
            # Send queue full or socket torn down: the frontend still aborts the request
            # when this connection goes away, so nothing is leaked.
            self._abandoned.discard(rid)


class Stream(Iterator[Chunk]):
    """Chunks of one streaming request. After the last one, `done` holds the Done event."""

    def __init__(self, client: Client, rid: str) -> None:
        self.id = rid
        self.done: Optional[Done] = None
        self._client = client
        self._finished = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if self._finished:
            raise StopIteration
        try:
            msg = self._client._next_for(self.id, ("chunk", "done", "error"))
        except EngineError:
            self.close()
            raise
        if msg["type"] == "chunk":
            return chunk_from_wire(msg)
        self._finished = True
        self._client._inbox.pop(self.id, None)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        self.done = done_from_wire(msg)
        raise StopIteration

    def close(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        if not self._finished:
            self._finished = True
            self._client._abandon(self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
