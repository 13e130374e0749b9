"""The blocking Python client: one DEALER connection to a frontend (docs/protocol.md).

Several requests may be in flight on one Client (e.g. two streams iterated in turns): replies
for ids other than the one being waited for are kept per id. When the connection drops while a
request is open (the frontend died), the client connects again (to its next address, or the
same one restarted) and resumes its open requests (shared/client/resume.py). A Client is not
thread-safe (ZeroMQ sockets are not); use one per thread. What frames mean is `ClientCore`'s
business (shared/client/core.py, shared with AsyncClient); this class only sends, polls and
receives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.addresses import DEFAULT_FRONTEND_ADDR
from shared.client.core import (
    ABORT_KINDS,
    DEFAULT_RESUME_TIMEOUT_S,
    EMBED_KINDS,
    RESULT_KINDS,
    STREAM_KINDS,
    ClientCore,
)
from shared.client.resume import RETRY_S
from shared.client.types import (
    Chunk,
    Completion,
    Done,
    Embedding,
    EngineError,
    completion_from_chunks,
    embedding_from_reply,
)
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES
from shared.protocol.errors import ErrorCode

DEFAULT_ADDRESS = DEFAULT_FRONTEND_ADDR  # kept: the public name of the client API


class Client:
    """`timeout`: seconds without any message from the frontend before EngineError
    (`engine_unreachable`). The frontend sends heartbeats while a request is in flight, so a
    long generation or a long queue does not hit it. `connect_timeout`: how long a request
    waits for a connection to the frontend before the same error (never longer than
    `timeout`). `server_key` / `client_key`: the server's public `.key` file and this client's
    `.key_secret` file, for a frontend started with `--curve-keys` (docs/protocol.md)."""

    def __init__(
        self,
        address: Union[str, Sequence[str]] = DEFAULT_ADDRESS,
        timeout: float = 60.0,
        context: Optional[zmq.Context] = None,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_key: Optional[Union[str, Path]] = None,
        client_key: Optional[Union[str, Path]] = None,
        resume_timeout: float = DEFAULT_RESUME_TIMEOUT_S,
    ) -> None:
        self._core = ClientCore(address, timeout, connect_timeout, max_frame_bytes, server_key,
                                client_key, resume_timeout)  # fmt: skip
        self.timeout = timeout
        self.connect_timeout = self._core.connect_timeout
        self._ctx = context or zmq.Context.instance()
        self._closed = False
        self._connect(self._core.address)

    @property
    def address(self) -> str:
        """The frontend in use now."""
        return self._core.address

    def _connect(self, address: str) -> None:
        """A DEALER to `address` and the monitor that tells when its connection drops."""
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing while not connected: a request to an absent frontend fails at once
        # (after connect_timeout) instead of waiting in a queue for the full timeout.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._core.secure(self._sock)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _disconnect(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

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
        rid = self._start(
            *self._core.generate(
                request_id, prompt, messages, prompt_token_ids, False, priority, params
            )
        )
        return self._core.completion(self._one_reply(rid, RESULT_KINDS))

    def embed(
        self,
        prompt: Optional[str] = None,
        *,
        prompt_token_ids: Optional[list[int]] = None,
        pooling: str = "last",
        priority: int = 0,
        request_id: Optional[str] = None,
        traceparent: Optional[str] = None,
    ) -> Embedding:
        """The prompt's pooled hidden state (docs/protocol.md `embed`); EngineError on error.
        `traceparent`: the caller's span (W3C), the parent of the request's trace."""
        rid = self._start(
            *self._core.embed(prompt, prompt_token_ids, pooling, priority, request_id, traceparent)
        )
        return embedding_from_reply(self._one_reply(rid, EMBED_KINDS))

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
        rid = self._start(
            *self._core.generate(
                request_id, prompt, messages, prompt_token_ids, True, priority, params
            )
        )
        return Stream(self, rid)

    def abort(self, request_id: str) -> bool:
        """Abort a request; True when it was in flight. Idempotent.

        A stream of that id still receives its final `done` (finish_reason "abort")."""
        opened, frame = self._core.abort(request_id)
        try:
            self._send(frame)
            msg = self._next_for(request_id, ABORT_KINDS)
        finally:
            if opened:
                self._core.forget(request_id)
        return bool(msg.get("found"))

    def health(self) -> dict[str, Any]:
        """The `health` reply: `ready`, `reason`, `model`, `max_model_len`, `vocab_size`, ..."""
        return self._query("health")

    def stats(self) -> dict[str, Any]:
        """The `stats` reply: `ready`, `frontend` and `engine` counters."""
        return self._query("stats")

    def reset_prefix_cache(self) -> int:
        """Empty the engine's prefix cache; the number of cached blocks dropped."""
        return int(self._query("reset_prefix_cache")["num_blocks_dropped"])

    def drain(self, engine: str, drain: bool = True) -> dict[str, Any]:
        """Maintenance: stop (or, `drain=False`, start again) admitting to engine `engine`
        (its name in `health`); the `drain` reply (`num_moved`: requests moved off it)."""
        return self._query("drain", engine=engine, drain=drain)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._disconnect()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport ---------------------------------------------------------------------------

    def _query(self, kind: str, **fields: Any) -> dict[str, Any]:
        qid, frame = self._core.query(kind, **fields)
        try:
            self._send(frame)
            msg = self._next_for(qid, (kind, "error"))
        finally:
            self._core.forget(qid)
        return self._core.query_result(msg)

    def _start(self, rid: str, frame: bytes) -> str:
        """Open `rid`'s box, then send its first frame."""
        self._core.open(rid, frame)
        try:
            self._send(frame)
        except EngineError:
            self._core.forget(rid)  # never sent: nothing to abort
            raise
        return rid

    def _send(self, frame: bytes) -> None:
        if self._closed:
            raise self._core.closed_error()
        if not self._sock.poll(int(self.connect_timeout * 1000), zmq.POLLOUT):
            raise self._core.connect_error()
        self._sock.send(frame)

    def _one_reply(self, rid: str, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The final reply of a non-streaming request; on a time-out the request is aborted in
        the engine (nothing left running) and EngineError raised."""
        try:
            msg = self._next_for(rid, kinds)
        except EngineError:
            self._abandon(rid)
            raise
        self._core.forget(rid)
        return msg

    def _next_for(self, rid: str, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The first kept or new reply for `rid` whose type is one of `kinds`; replies for
        other ids are kept on the way. EngineError after `timeout` s without any frame."""
        last_rx = time.monotonic()
        while True:
            msg = self._core.take(rid, kinds)
            if msg is not None:
                return msg
            wait = last_rx + self.timeout - time.monotonic()
            if wait <= 0:
                raise self._core.silence_error()
            if self._core.open_requests.retrying():  # resumed ones to send again
                wait = min(wait, RETRY_S / 2)
                for _rid, frame in self._core.retry_frames():
                    self._sock.send(frame)
            events = dict(self._poller.poll(int(wait * 1000) + 1))
            if self._monitor in events and self._dropped() and self._core.open_ids():
                self._resume()
                last_rx = time.monotonic()
                continue
            if self._sock in events:
                last_rx = time.monotonic()
                self._core.receive(self._sock.recv())

    def _dropped(self) -> bool:
        """Whether the monitor says the connection dropped (reads its events)."""
        dropped = False
        while self._monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self._monitor)
            dropped |= event["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def _resume(self) -> None:
        """The frontend was lost: connect to the next one (or the same, restarted) until one
        takes frames or `resume_timeout` passes, then send every open request again (streams
        resumed, shared/client/resume.py); when none came back, they fail."""
        core = self._core
        deadline = time.monotonic() + core.resume_timeout
        while True:
            self._disconnect()
            self._connect(core.next_address())
            wait_s = max(0.0, min(self.connect_timeout, deadline - time.monotonic()))
            if self._sock.poll(int(wait_s * 1000), zmq.POLLOUT):
                for _rid, frame in core.resume_frames():
                    self._sock.send(frame)
                return
            if time.monotonic() >= deadline:
                for rid in core.open_ids():
                    core.fail(rid, f"no frontend answered within {core.resume_timeout:g} s")
                return

    def _abandon(self, rid: str) -> None:
        """Abort without waiting (a stream closed early); its late replies are dropped."""
        frame = self._core.abandon(rid)
        if frame is None or self._closed:
            return
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            # Send queue full or socket torn down: the frontend still aborts the request
            # when this connection goes away, so nothing is leaked.
            self._core.abort_unsent(rid)


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
            msg = self._client._next_for(self.id, STREAM_KINDS)
        except EngineError:
            self.close()
            raise
        if msg["type"] != "chunk":
            self._finished = True
            self._client._core.forget(self.id)
        event = self._client._core.stream_event(msg)  # raises on `error`
        if isinstance(event, Chunk):
            return event
        self.done = event
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
