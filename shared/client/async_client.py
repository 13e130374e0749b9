"""The asyncio Python client: one DEALER connection shared by many concurrent requests.

A reader task (started on first use, in the running loop) receives every reply, lets
`ClientCore` (shared/client/core.py, shared with the blocking Client) route it to its request
and wakes that request's waiters. Cancelling the task that awaits a request, or closing/dropping
its stream early, aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Optional, Union

import zmq
import zmq.asyncio

from shared.client.core import ABORT_KINDS, EMBED_KINDS, RESULT_KINDS, STREAM_KINDS, ClientCore
from shared.client.sync_client import DEFAULT_ADDRESS
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


class AsyncClient:
    """Same interface as `Client`, with coroutines; `stream()` returns an async iterator."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float = 60.0,
        context: Optional[zmq.asyncio.Context] = None,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_key: Optional[Union[str, Path]] = None,
        client_key: Optional[Union[str, Path]] = None,
        routing_id: Optional[bytes] = None,
    ) -> None:
        self._core = ClientCore(
            address, timeout, connect_timeout, max_frame_bytes, server_key, client_key
        )
        self.routing_id = routing_id  # the connection's ZeroMQ identity; None: random
        self.address = address
        self.timeout = timeout
        self.connect_timeout = self._core.connect_timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeups: dict[str, asyncio.Event] = {}  # id -> set when a reply for it arrives
        self._last_rx = 0.0
        self._closed = False

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
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
        if stream:
            it = self.stream(
                prompt,
                messages=messages,
                prompt_token_ids=prompt_token_ids,
                priority=priority,
                request_id=request_id,
                **params,
            )
            chunks = [chunk async for chunk in it]
            if it.done is None:  # the iterator ends only after `done` or by raising
                raise EngineError(ErrorCode.INTERNAL, "stream ended without `done`")
            return completion_from_chunks(it.done, chunks)
        rid, frame = self._core.generate(
            request_id, prompt, messages, prompt_token_ids, False, priority, params
        )
        await self._start(rid, frame)
        try:
            msg = await self._next_for(rid, RESULT_KINDS)
        except BaseException:
            self._abandon(rid)  # cancelled or timed out: don't leave it running
            raise
        self._forget(rid)
        return self._core.completion(msg)

    def stream(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[list[int]] = None,
        priority: int = 0,
        request_id: Optional[str] = None,
        **params: Any,
    ) -> AsyncStream:
        """The request is sent on the first `__anext__`; `.id` is known at once."""
        rid, frame = self._core.generate(
            request_id, prompt, messages, prompt_token_ids, True, priority, params
        )
        return AsyncStream(self, rid, frame)

    async def embed(
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
        rid, frame = self._core.embed(
            request_id, prompt, prompt_token_ids, pooling, priority, traceparent
        )
        await self._start(rid, frame)
        try:
            msg = await self._next_for(rid, EMBED_KINDS)
        except BaseException:
            self._abandon(rid)  # cancelled or timed out: don't leave it running
            raise
        self._forget(rid)
        return embedding_from_reply(msg)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True when it was in flight. Idempotent.

        A stream of that id still receives its final `done` (finish_reason "abort")."""
        opened, frame = self._core.abort(request_id)
        try:
            await self._send(frame)
            msg = await self._next_for(request_id, ABORT_KINDS)
        finally:
            if opened:
                self._forget(request_id)
        return bool(msg.get("found"))

    async def health(self) -> dict[str, Any]:
        return await self._query("health")

    async def stats(self) -> dict[str, Any]:
        return await self._query("stats")

    async def reset_prefix_cache(self) -> int:
        """Empty the engine's prefix cache; the number of cached blocks dropped."""
        return int((await self._query("reset_prefix_cache"))["num_blocks_dropped"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- transport ---------------------------------------------------------------------------

    async def _query(self, kind: str) -> dict[str, Any]:
        qid, frame = self._core.query(kind)
        try:
            await self._send(frame)
            msg = await self._next_for(qid, (kind, "error"))
        finally:
            self._forget(qid)
        return self._core.query_result(msg)

    async def _start(self, rid: str, frame: bytes) -> None:
        """Open `rid`'s box, then send its first frame."""
        self._core.open(rid)
        try:
            await self._send(frame)
        except BaseException:
            self._forget(rid)  # never sent: nothing to abort
            raise

    async def _send(self, frame: bytes) -> None:
        if self._closed:
            raise self._core.closed_error()
        if self._sock is None:
            self._loop = asyncio.get_running_loop()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.routing_id is not None:
                self._sock.setsockopt(zmq.IDENTITY, self.routing_id)
            self._sock.setsockopt(zmq.IMMEDIATE, 1)  # as in Client: queue nothing unconnected
            self._core.secure(self._sock)
            self._sock.connect(self.address)
            self._reader = asyncio.create_task(self._read())
        if not await self._sock.poll(int(self.connect_timeout * 1000), zmq.POLLOUT):
            raise self._core.connect_error()
        await self._sock.send(frame)

    async def _read(self) -> None:
        """The reader task: every reply is routed, and its request's waiters woken."""
        sock = self._sock
        if sock is None:
            return
        while not self._closed:
            try:
                frame = await sock.recv()
            except zmq.ZMQError:
                return  # socket closed under us: close() is running
            self._last_rx = time.monotonic()
            rid = self._core.receive(frame)
            wakeup = self._wakeups.get(rid) if rid is not None else None
            if wakeup is not None:
                wakeup.set()

    async def _next_for(self, rid: str, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The first reply for `rid` of one of `kinds`; EngineError when the frontend is silent
        (no frame at all, heartbeats included) for `timeout`."""
        started = time.monotonic()
        wakeup = self._wakeups.setdefault(rid, asyncio.Event())
        while True:
            msg = self._core.take(rid, kinds)
            if msg is not None:
                return msg
            wait = max(started, self._last_rx) + self.timeout - time.monotonic()
            if wait <= 0:
                raise self._core.silence_error()
            wakeup.clear()  # no await since `take`: nothing can have arrived in between
            try:
                await asyncio.wait_for(wakeup.wait(), wait)
            except asyncio.TimeoutError:
                continue  # re-check against the latest reply of any request (heartbeats)

    def _forget(self, rid: str) -> None:
        self._core.forget(rid)
        self._wakeups.pop(rid, None)

    def _abandon(self, rid: str) -> None:
        """Abort without waiting; late replies for `rid` are dropped. Runs in the loop."""
        self._wakeups.pop(rid, None)
        frame = self._core.abandon(rid)
        if frame is None or self._closed or self._sock is None:
            return
        sent = self._sock.send(frame)
        # Nobody awaits this send; retrieve its outcome so a failure is not reported as lost.
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _abandon_threadsafe(self, rid: str) -> None:
        """From a finalizer, which may run outside the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._abandon, rid)


class AsyncStream(AsyncIterator[Chunk]):
    """Chunks of one streaming request. After the last one, `done` holds the Done event."""

    def __init__(self, client: AsyncClient, rid: str, frame: bytes) -> None:
        self.id = rid
        self.done: Optional[Done] = None
        self._client = client
        self._frame: Optional[bytes] = frame  # sent on the first __anext__
        self._finished = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._frame is not None:
                frame, self._frame = self._frame, None
                await self._client._start(self.id, frame)
            msg = await self._client._next_for(self.id, STREAM_KINDS)
        except BaseException:
            await self.aclose()  # cancelled, timed out or the send failed
            raise
        if msg["type"] != "chunk":
            self._finished = True
            self._client._forget(self.id)
        event = self._client._core.stream_event(msg)  # raises on `error`
        if isinstance(event, Chunk):
            return event
        self.done = event
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it was sent and has not finished."""
        if not self._finished:
            self._finished = True
            if self._frame is None:
                self._client._abandon(self.id)

    def __del__(self) -> None:
        if not self._finished and self._frame is None:
            self._finished = True
            self._client._abandon_threadsafe(self.id)
