"""The asyncio Python client: one DEALER connection shared by many concurrent requests.

A reader task (started on first use, in the running loop) receives every reply and hands it to
the queue of its request id; each request awaits its own queue. Cancelling the task that awaits
a request, or closing/dropping its stream early, aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Optional

import zmq
import zmq.asyncio

from shared.client.sync_client import DEFAULT_ADDRESS
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


class AsyncClient:
    """Same interface as `Client`, with coroutines; `stream()` returns an async iterator."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float = 60.0,
        context: Optional[zmq.asyncio.Context] = None,
        connect_timeout: float = 5.0,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be > 0")
        self.address = address
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._abandoned: set[str] = set()
        self._abort_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
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
        rid = request_id or uuid.uuid4().hex
        fields = request_fields(prompt, messages, prompt_token_ids, False, priority, params)
        await self._start(rid, encode_client_message("generate", rid, **fields))
        try:
            msg = await self._next_for(rid)
        except BaseException:
            self._abandon(rid)  # cancelled or timed out: don't leave it running
            raise
        self._queues.pop(rid, None)
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
    ) -> AsyncStream:
        """The request is sent on the first `__anext__`; `.id` is known at once."""
        rid = request_id or uuid.uuid4().hex
        fields = request_fields(prompt, messages, prompt_token_ids, True, priority, params)
        return AsyncStream(self, rid, encode_client_message("generate", rid, **fields))

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True when it was in flight. Idempotent.

        A stream of that id still receives its final `done` (finish_reason "abort")."""
        self._abandoned.discard(request_id)  # its `aborted` now answers this call
        acked: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._abort_waiters[request_id] = acked
        try:
            await self._send(encode_client_message("abort", request_id))
            msg = await self._wait(lambda: asyncio.shield(acked))
        finally:
            self._abort_waiters.pop(request_id, None)
        return bool(msg.get("found"))

    async def health(self) -> dict[str, Any]:
        return await self._query("health")

    async def stats(self) -> dict[str, Any]:
        return await self._query("stats")

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

    # ---- plumbing ----------------------------------------------------------------------------

    async def _query(self, kind: str) -> dict[str, Any]:
        qid = f"{kind}-{uuid.uuid4().hex}"
        await self._start(qid, encode_client_message(kind, qid))
        try:
            msg = await self._next_for(qid)
        finally:
            self._queues.pop(qid, None)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        return msg

    async def _start(self, rid: str, frame: bytes) -> None:
        """Register `rid`'s queue, then send its first frame."""
        self._queues[rid] = asyncio.Queue()
        try:
            await self._send(frame)
        except BaseException:
            self._queues.pop(rid, None)  # never sent: nothing to abort
            raise

    async def _send(self, frame: bytes) -> None:
        if self._closed:
            raise EngineError(ErrorCode.ENGINE_UNREACHABLE, "the client is closed")
        if self._sock is None:
            self._loop = asyncio.get_running_loop()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.IMMEDIATE, 1)  # as in Client: queue nothing unconnected
            self._sock.connect(self.address)
            self._reader = asyncio.create_task(self._read())
        if not await self._sock.poll(int(self.connect_timeout * 1000), zmq.POLLOUT):
            raise EngineError(
                ErrorCode.ENGINE_UNREACHABLE,
                f"cannot connect to {self.address} within {self.connect_timeout:g} s",
            )
        await self._sock.send(frame)

    async def _read(self) -> None:
        """The reader task: every reply goes to its request's queue."""
        sock = self._sock
        if sock is None:
            return
        while not self._closed:
            try:
                frame = await sock.recv()
            except zmq.ZMQError:
                return  # socket closed under us: close() is running
            self._last_rx = time.monotonic()
            self._dispatch(frame)

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = decode_reply(frame)
        except DecodeError:
            return  # not a protocol reply: ignore, as the protocol asks of unknown input
        rid = msg.get("id")
        if not isinstance(rid, str):
            return  # heartbeat (liveness already noted) or an error about no request of ours
        if rid in self._abandoned:
            if msg["type"] == "aborted":
                self._abandoned.discard(rid)
            return
        if msg["type"] == "aborted":
            acked = self._abort_waiters.get(rid)
            if acked is not None and not acked.done():
                acked.set_result(msg)
            return
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(msg)

    async def _next_for(self, rid: str) -> dict[str, Any]:
        """The next reply for `rid`; EngineError when the frontend is silent for `timeout`."""
        return await self._wait(self._queues[rid].get)

    async def _wait(self, get: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        started = time.monotonic()
        while True:
            wait = max(started, self._last_rx) + self.timeout - time.monotonic()
            if wait <= 0:
                raise EngineError(
                    ErrorCode.ENGINE_UNREACHABLE,
                    f"no reply from {self.address} within {self.timeout:g} s",
                )
            try:
                return await asyncio.wait_for(get(), wait)
            except asyncio.TimeoutError:
                continue  # re-check against the latest reply of any request (heartbeats)

    def _abandon(self, rid: str) -> None:
        """Abort without waiting; late replies for `rid` are dropped. Runs in the loop."""
        if self._queues.pop(rid, None) is None or self._closed or self._sock is None:
            return
        self._abandoned.add(rid)
        sent = self._sock.send(encode_client_message("abort", rid))
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
            msg = await self._client._next_for(self.id)
        except BaseException:
            await self.aclose()  # cancelled, timed out or the send failed
            raise
        if msg["type"] == "chunk":
            return chunk_from_wire(msg)
        self._finished = True
        self._client._queues.pop(self.id, None)
        if msg["type"] == "error":
            raise error_from_wire(msg)
        self.done = done_from_wire(msg)
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
