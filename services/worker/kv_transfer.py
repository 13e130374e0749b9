"""KV hand-over between workers (docs/design/disaggregation.md): a prefill worker serves the
blocks its scheduler leased; a decode worker pulls them into blocks its scheduler allocated.

Both run inside the worker loop's thread (services/worker/loop.py), between steps: a read is
served from blocks no plan can write while their lease lasts (the scheduler frees them only
after `EndLease`, which reaches this worker before any plan that may reuse them), and a pull
writes blocks no sequence holds yet. The transfer is ZeroMQ (shared/protocol/kv_channel.py):
the prefill worker gathers the leased blocks into one buffer and sends it as a frame without a
copy; the decode worker views the frame's buffer as a tensor and scatters it into its pool.
CURVE (a `conveyor keys generate` folder): the prefill worker serves with the server key pair
and admits `authorized_workers/`; decode workers connect with the worker key pair. The bytes
come from and go to a `KvPool`: the real worker's KV cache (kv_pool.py), or the simulated
worker's modelled link (sim/kv_link.py); this module imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import zmq

from shared.curve import (
    AUTHORIZED_WORKERS_DIR,
    WORKERS_DOMAIN,
    make_curve_client,
    make_curve_server,
    server_public_path,
    start_authenticator,
    stop_authenticator,
    worker_secret_path,
)
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.kv_channel import KvRead, KvReadReply
from shared.protocol.worker_channel import EndLease, GrantLease, KvPulled, PullKv

LEASE_UNKNOWN = "lease_unknown"  # no such lease, or another generation: freed, maybe reused
GRANT_WAIT_S = 0.5  # a read of a lease newer than every grant waits this long for its grant


@dataclass(frozen=True, slots=True)
class KvExport:
    """Leased blocks ready to send: the payload frame (a buffer, sent without a copy) and the
    layout its KvReadReply announces."""

    shape: list[int]
    dtype: str
    payload: Any


class KvLayoutError(ValueError):
    """A pulled payload whose shape or dtype is not the puller's pool's."""


class KvPool(Protocol):
    """Where a worker's KV blocks are read for a lease and written by a pull; called by
    KvTransfer between steps, on blocks no plan writes meanwhile."""

    def export(self, block_ids: list[int]) -> KvExport: ...

    def load(self, block_ids: list[int], shape: list[int], dtype: str, payload: Any) -> int:
        """Write `payload` into `block_ids`; its bytes. Raises KvLayoutError."""
        ...


class KvTransfer:
    """One per worker process with a KV pool. `server` (a ROUTER, prefill workers only) goes
    into the loop's poller; `on_message` takes the worker-channel messages of the hand-over.
    Owns the leases this worker may serve (lease id -> (generation, blocks)) and one DEALER
    per prefill worker it pulled from."""

    def __init__(
        self,
        pool: KvPool,
        context: zmq.Context,
        log: Any,
        bind_addr: Optional[str] = None,
        curve_keys: Optional[Path] = None,
        pull_timeout_s: float = 1.0,
    ) -> None:
        self._pool = pool
        self._context = context
        self._log = log
        self._curve_keys = curve_keys
        self._pull_timeout_ms = max(1, int(pull_timeout_s * 1000))
        self._leases: dict[int, tuple[int, list[int]]] = {}
        self._max_granted = 0  # the newest lease granted (ids only grow)
        self._deferred: list[tuple[bytes, KvRead, float]] = []  # reads waiting for a grant
        self._peers: dict[str, zmq.Socket] = {}
        self.server: Optional[zmq.Socket] = None
        self.endpoint = ""
        self._auth = None
        if bind_addr is not None:
            self.server = context.socket(zmq.ROUTER)
            if curve_keys is not None:  # only other workers' keys are admitted
                domains = {WORKERS_DOMAIN: AUTHORIZED_WORKERS_DIR}
                self._auth = start_authenticator(context, curve_keys, log, domains=domains)
                make_curve_server(self.server, curve_keys, log, zap_domain=WORKERS_DOMAIN)
            self.server.setsockopt(zmq.LINGER, 0)
            self.server.bind(bind_addr)
            self.endpoint = self.server.getsockopt(zmq.LAST_ENDPOINT).decode()
            log.info("kv_server_listening", endpoint=self.endpoint, curve=curve_keys is not None)

    def handles(self, msg: Any) -> bool:
        """Whether `msg` (from the scheduler) is one of the hand-over's."""
        return isinstance(msg, (GrantLease, EndLease, PullKv))

    def on_message(self, msg: Any) -> Optional[KvPulled]:
        """A hand-over message from the scheduler; the answer to send back (PullKv only)."""
        if isinstance(msg, GrantLease):
            self._leases[msg.lease_id] = (msg.generation, list(msg.block_ids))
            self._max_granted = max(self._max_granted, msg.lease_id)
            self._retry_deferred()
            return None
        if isinstance(msg, EndLease):
            self._leases.pop(msg.lease_id, None)
            return None
        return self._pull(msg)

    # ---- prefill side ------------------------------------------------------------------------

    def on_readable(self) -> None:
        """The KV server is readable: answer every read waiting (one frame each)."""
        assert self.server is not None
        now = time.monotonic()
        while self.server.poll(0, zmq.POLLIN):
            parts = self.server.recv_multipart(copy=False)
            ident = parts[0].bytes
            try:
                msg = decode(parts[-1].buffer)
            except DecodeError as exc:
                self._refuse(ident, exc.code, exc.message)
                continue
            if not isinstance(msg, KvRead):
                self._refuse(ident, "unexpected_type", type(msg).__name__)
                continue
            self._answer(ident, msg, now + GRANT_WAIT_S)

    def tick(self, now: float) -> None:
        """Called every loop turn: reads that waited for their grant past their time fail."""
        late = [d for d in self._deferred if d[2] <= now]
        self._deferred = [d for d in self._deferred if d[2] > now]
        for ident, msg, _ in late:
            self._answer(ident, msg, now)

    def _answer(self, ident: bytes, msg: KvRead, wait_until: float) -> None:
        """Serve a read of a lease held with its generation; refuse any other, except one
        for a lease newer than every grant so far while `wait_until` has not passed: its
        GrantLease may still be behind a plan on the scheduler's socket (this worker was
        busy), so it waits for it (`_retry_deferred`, `tick`)."""
        lease = self._leases.get(msg.lease_id)
        if lease is None and msg.lease_id > self._max_granted and time.monotonic() < wait_until:
            self._deferred.append((ident, msg, wait_until))
            return
        if lease is None or lease[0] != msg.generation:
            message = f"lease {msg.lease_id} generation {msg.generation} is not held"
            self._refuse(ident, LEASE_UNKNOWN, message)
            return
        assert self.server is not None
        out = self._pool.export(lease[1])
        head = KvReadReply(True, shape=out.shape, dtype=out.dtype)
        self.server.send_multipart([ident, encode(head), out.payload], copy=False)

    def _retry_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for ident, msg, wait_until in waiting:
            self._answer(ident, msg, wait_until)

    def _refuse(self, ident: bytes, code: str, message: str) -> None:
        self._log.warning("kv_read_refused", code=code, message=message)
        assert self.server is not None
        self.server.send_multipart([ident, encode(KvReadReply(False, code, message))])

    # ---- decode side -------------------------------------------------------------------------

    def _pull(self, msg: PullKv) -> KvPulled:
        """Read `msg.source` from its prefill worker into `msg.block_ids` (blocking, at most
        the pull time-out). Never raises for a peer's fault: the answer says what failed."""
        began = time.perf_counter()
        src = msg.source
        sock = self._peer(src.kv_endpoint)
        sock.send(encode(KvRead(src.lease_id, src.generation)))
        if not sock.poll(self._pull_timeout_ms, zmq.POLLIN):
            self._drop_peer(src.kv_endpoint)  # a late answer must not meet the next read
            return self._failed(msg, "timeout", f"no answer from {src.kv_endpoint}")
        parts = sock.recv_multipart(copy=False)
        try:
            head = decode(parts[0].buffer)
        except DecodeError as exc:
            return self._failed(msg, exc.code, exc.message)
        if not isinstance(head, KvReadReply) or not head.ok or len(parts) != 2:
            code = head.code if isinstance(head, KvReadReply) else "unexpected_type"
            return self._failed(msg, code or "bad_reply", getattr(head, "message", ""))
        try:
            num_bytes = self._pool.load(msg.block_ids, head.shape, head.dtype, parts[1].buffer)
        except KvLayoutError as exc:
            return self._failed(msg, "kv_layout_mismatch", str(exc))
        seconds = time.perf_counter() - began
        self._log.info("kv_pulled", rid=msg.rid, num_blocks=len(msg.block_ids),
                       num_bytes=num_bytes, seconds=seconds, source=src.kv_endpoint)  # fmt: skip
        return KvPulled(msg.rid, True, num_bytes, seconds)

    def _failed(self, msg: PullKv, code: str, message: str) -> KvPulled:
        self._log.warning("kv_pull_failed", rid=msg.rid, code=code, message=message)
        return KvPulled(msg.rid, False, code=code, message=message)

    def _peer(self, endpoint: str) -> zmq.Socket:
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            if self._curve_keys is not None:
                keys = self._curve_keys
                make_curve_client(sock, server_public_path(keys), worker_secret_path(keys))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        return sock

    def _drop_peer(self, endpoint: str) -> None:
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Called once when the loop ends."""
        for sock in self._peers.values():
            sock.close()
        self._peers.clear()
        if self.server is not None:
            self.server.close()
        stop_authenticator(self._auth)
