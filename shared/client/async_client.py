"""The asyncio Python client: one DEALER connection shared by many concurrent requests.

A reader task (started on first use, in the running loop) receives every reply, lets
`ClientCore` (shared/client/core.py, shared with the blocking Client) route it to its request
and wakes that request's waiters. Cancelling the task that awaits a request, or closing/dropping
its stream early, aborts the request in the engine.

A watcher task reads the socket's monitor: when the connection to the frontend drops (the
frontend died), the client connects again, to the next of its addresses (the same one when it
has one: a restarted frontend), for up to `resume_timeout` seconds, and sends every open request
again, streams resumed after the tokens they have (shared/client/resume.py). The requests'
waiters see nothing but a later next chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared.client.core import (
    ABORT_KINDS,
    DEFAULT_RESUME_TIMEOUT_S,
    RESULT_KINDS,
    STREAM_KINDS,
    ClientCore,
    Embedding,
)
from shared.client.resume import RETRY_S
from shared.client.sync_client import DEFAULT_ADDRESS
from shared.client.types import Chunk, Completion, Done, EngineError, completion_from_chunks
from shared.protocol.client_channel import DEFAULT_MAX_FRAME_BYTES
from shared.protocol.errors import ErrorCode


class AsyncClient:
    """Same interface as `Client`, with coroutines; `stream()` returns an async iterator."""

    def __init__(
        self,
        address: Union[str, Sequence[str]] = DEFAULT_ADDRESS,
        timeout: float = 60.0,
        context: Optional[zmq.asyncio.Context] = None,
        connect_timeout: float = 5.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        server_key: Optional[Union[str, Path]] = None,
        client_key: Optional[Union[str, Path]] = None,
        routing_id: Optional[bytes] = None,
        resume_timeout: float = DEFAULT_RESUME_TIMEOUT_S,
    ) -> None:
        """`address`: one frontend, or several (tried in turn when the one in use is lost).
        `resume_timeout`: how long to look for a frontend after a loss (0: open requests
        fail with `engine_unreachable` at once, as with no resumption)."""
        self._core = ClientCore(address, timeout, connect_timeout, max_frame_bytes, server_key,
                                client_key, resume_timeout)  # fmt: skip
        self.routing_id = routing_id  # the connection's ZeroMQ identity; None: random
        self.timeout = timeout
        self.connect_timeout = self._core.connect_timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self._watcher: Optional[asyncio.Task] = None
        self._num_sockets = 0  # connections made so far (each later one: its own identity)
        self._retrier: Optional[asyncio.Task] = None  # sends resumed requests again (_resume)
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
        return self._core.completion(await self._request(rid, frame, RESULT_KINDS))

    async def _request(self, rid: str, frame: bytes, kinds: tuple[str, ...]) -> dict[str, Any]:
        await self._start(rid, frame)
        try:
            msg = await self._next_for(rid, kinds)
        except BaseException:
            self._abandon(rid)  # cancelled or timed out: don't leave it running
            raise
        self._forget(rid)
        return msg

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

    async def embed(self, prompt: Optional[str] = None, **fields: Any) -> Embedding:
        """As `Client.embed` (the same keywords): ends with `embedding`, or `done` if aborted."""
        rid, frame = self._core.embed(prompt, **fields)
        return self._core.embedding(await self._request(rid, frame, ("embedding", *RESULT_KINDS)))

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

    @property
    def address(self) -> str:
        """The frontend in use now."""
        return self._core.address

    async def drain(self, engine: str, drain: bool = True) -> dict[str, Any]:
        """Maintenance: stop (or, `drain=False`, start again) admitting to engine `engine`
        (its name in `health`); the `drain` reply (`num_moved`: requests moved off it)."""
        return await self._query("drain", engine=engine, drain=drain)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_socket()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- transport ---------------------------------------------------------------------------

    async def _query(self, kind: str, **fields: Any) -> dict[str, Any]:
        qid, frame = self._core.query(kind, **fields)
        try:
            await self._send(frame)
            msg = await self._next_for(qid, (kind, "error"))
        finally:
            self._forget(qid)
        return self._core.query_result(msg)

    async def _start(self, rid: str, frame: bytes) -> None:
        """Open `rid`'s box, then send its first frame."""
        self._core.open(rid, frame)
        try:
            await self._send(frame)
        except BaseException:
            self._forget(rid)  # never sent: nothing to abort
            raise
            raise

    async def _send(self, frame: bytes) -> None:
        """Send on the connection in use, waiting up to `connect_timeout` for one (a
        resumption may replace it meanwhile: the wait follows the new one)."""
        if self._closed:
            raise self._core.closed_error()
        if self._sock is None:
            self._loop = asyncio.get_running_loop()
            self._open_socket(self._core.address)
        deadline = time.monotonic() + self.connect_timeout
        while True:
            sock = self._sock
            assert sock is not None
            wait_ms = int(min(0.2, max(0.0, deadline - time.monotonic())) * 1000)
            if await sock.poll(wait_ms, zmq.POLLOUT) and sock is self._sock:
                await sock.send(frame)
                return
            if self._closed:
                raise self._core.closed_error()
            if time.monotonic() >= deadline:
                raise self._core.connect_error()

    def _open_socket(self, address: str) -> None:
        """A DEALER to `address`, its reader and its watcher. Each connection after the first
        has an identity of its own (the routing id and a count): the frontend tells it from
        the lost one, whose requests it may not have seen go yet."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.routing_id is not None:
            suffix = f".{self._num_sockets}".encode() if self._num_sockets else b""
            sock.setsockopt(zmq.IDENTITY, self.routing_id + suffix)
        self._num_sockets += 1
        sock.setsockopt(zmq.IMMEDIATE, 1)  # as in Client: queue nothing unconnected
        self._core.secure(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self._sock = sock
        self._reader = asyncio.create_task(self._read(sock))
        self._watcher = asyncio.create_task(self._watch(sock, monitor))

    def _close_socket(self) -> None:
        for task in (self._reader, self._watcher, self._retrier):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """The reader task: every reply is routed, and its request's waiters woken."""
        while not self._closed:
            try:
                frame = await sock.recv()
            except zmq.ZMQError:
                return  # socket closed under us: close() or a resumption is running
            self._last_rx = time.monotonic()
            self._wake(self._core.receive(frame))

    async def _send_retries(self) -> None:
        """After a resumption: resumed requests the new frontend was not ready for go again
        (ClientCore.retry_frames), until none is left to send."""
        core = self._core
        deadline = time.monotonic() + core.resume_timeout + 1.0
        while not self._closed and time.monotonic() < deadline:
            await asyncio.sleep(RETRY_S / 2)
            sock = self._sock
            for _rid, frame in core.retry_frames():
                if sock is not None:
                    await sock.send(frame)

    def _wake(self, rid: Optional[str]) -> None:
        wakeup = self._wakeups.get(rid) if rid is not None else None
        if wakeup is not None:
            wakeup.set()

    async def _watch(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """The watcher task: a dropped connection with requests open starts a resumption."""
        try:
            while not self._closed:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] != zmq.EVENT_DISCONNECTED or sock is not self._sock:
                    continue
                if self._core.open_ids() or len(self._core.addresses) > 1:
                    await self._resume()
                    return
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        finally:
            monitor.close(linger=0)

    async def _resume(self) -> None:
        """The frontend in use was lost: connect to the next one (or the same, restarted)
        until one takes frames or `resume_timeout` passes, then send every open request again
        (streams resumed); when none came back, the open requests fail."""
        core = self._core
        deadline = time.monotonic() + core.resume_timeout
        while not self._closed:
            self._close_socket()
            self._open_socket(core.next_address())
            sock = self._sock
            assert sock is not None
            wait_s = max(0.0, min(self.connect_timeout, deadline - time.monotonic()))
            if await sock.poll(int(wait_s * 1000), zmq.POLLOUT):
                for rid, frame in core.resume_frames():
                    await sock.send(frame)
                    self._wake(rid)
                for rid in core.open_ids():
                    self._wake(rid)  # those that failed (resumed too often) see their error
                if self._retrier is None or self._retrier.done():
                    self._retrier = asyncio.create_task(self._send_retries())
                return
            if time.monotonic() >= deadline:
                for rid in core.open_ids():
                    core.fail(rid, f"no frontend answered within {core.resume_timeout:g} s")
                    self._wake(rid)
                return

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
            timer = asyncio.get_running_loop().call_later(wait, wakeup.set)  # then re-check
            await wakeup.wait()  # not wait_for: on 3.11 it can swallow a cancellation
            timer.cancel()

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
