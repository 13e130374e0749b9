"""KV hand-over between workers (docs/design/disaggregation.md): a prefill worker serves the
blocks its scheduler leased; a decode worker pulls them into blocks its scheduler allocated.

Both run inside the worker loop's thread (services/worker/loop.py), between steps: a read is
served from blocks no plan can write while their lease lasts (the scheduler frees them only
after `EndLease`, which reaches this worker before any plan that may reuse them), and a pull
writes blocks no sequence holds yet. A pull does not hold up the loop: `PullKv` sends the read
and returns; the loop polls the pull's socket beside the plan socket, steps go on, and the
`KvPulled` goes out (`take_answers`) once the reply has landed and been written. The transfer is
ZeroMQ (shared/protocol/kv_channel.py): the prefill worker gathers the leased blocks into one
buffer and sends it as a frame without a copy; the decode worker views the frame's buffer as a
tensor and scatters it into its pool (ZeroMQ's I/O thread receives it while a step computes).
CURVE (a `conveyor keys generate` folder): the prefill worker serves with the server key pair
and admits `authorized_workers/`; decode workers connect with the worker key pair. The bytes
come from and go to a `KvPool` (kv_shards.py, with which KV heads a rank reads where): the
real worker's KV cache (kv_pool.py), or the simulated worker's modelled link
(sim/kv_link.py); this module imports no torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import zmq

from services.worker.inbox import PlanInbox
from services.worker.kv_shards import KvLayoutError, KvPool, ShardRead, shard_reads
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
TP_MISMATCH = "kv_tp_mismatch"  # the prefill worker's KV-head shards cannot be re-sharded into ours
BAD_HEADS = "kv_bad_heads"  # a read of heads this rank does not hold
GRANT_WAIT_S = 0.5  # a read of a lease newer than every grant waits this long for its grant


@dataclass(slots=True)
class _Pull:
    """A PullKv in flight: its reads (one per prefill rank it reads from: kv_shards.py) sent
    at `began` (perf_counter); failed at `deadline` unless all answered; once all are answered
    and loaded, reported at `landed_at`."""

    msg: PullKv
    began: float
    deadline: float
    keys: list[tuple[str, int, int]]  # its reads' (endpoint, lease, generation)
    num_left: int  # reads not answered yet
    num_bytes: int = 0
    landed_at: Optional[float] = None


class KvTransfer:
    """One per worker process with a KV pool. `attach` puts its sockets into the loop's poller
    (`server`, a ROUTER, on prefill workers; one DEALER per prefill worker pulled from);
    `on_events` serves what they bring; `on_message` takes the worker-channel messages of the
    hand-over; `take_answers` hands out the KvPulled to send. Owns the leases this worker may
    serve (lease id -> (generation, blocks)) and the pulls in flight. A tensor-parallel worker
    has one per rank (kv_ranks.py): rank r serves its own KV-head shard (or the slice of it a
    read names), pulls its heads from the ranks of the other side that hold them (kv_shards.py:
    rank r of an equal-sized group), and answers each pull itself (`KvPulled.rank`)."""

    def __init__(
        self,
        pool: KvPool,
        context: zmq.Context,
        log: Any,
        bind_addr: Optional[str] = None,
        curve_keys: Optional[Path] = None,
        pull_timeout_s: float = 1.0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._pool = pool
        self._rank = rank
        self._world_size = world_size
        self._context = context
        self._log = log
        self._curve_keys = curve_keys
        self._pull_timeout_s = pull_timeout_s
        self._leases: dict[int, tuple[int, list[int]]] = {}
        self._max_granted = 0  # the newest lease granted (ids only grow)
        self._deferred: list[tuple[bytes, KvRead, float]] = []  # reads waiting for a grant
        self._peers: dict[str, zmq.Socket] = {}
        self._pulls: list[_Pull] = []
        self._reads: dict[tuple[str, int, int], tuple[_Pull, ShardRead]] = {}  # by their keys
        self._answers: list[KvPulled] = []
        self._pollers: list[zmq.Poller] = []
        self._inbox: Optional[PlanInbox] = None
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

    def attach(self, poller: zmq.Poller, inbox: Optional[PlanInbox] = None) -> None:
        """Called once by the worker loop: its poller watches this transfer's sockets (the
        server and every pull connection, as they come and go); `inbox`, its plan socket's,
        lets `serve_until` take lease messages out of the plan stream."""
        self._pollers.append(poller)
        self._inbox = inbox
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)

    def serve_until(self, deadline: float, one_sided: bool) -> None:
        """Called by a simulated step while it waits for its modelled end (`deadline`,
        perf_counter): pull replies land meanwhile; `one_sided`, reads are answered and the
        hand-over's messages taken from the plan stream (inbox.py) as they come. Returns
        within ~1 ms of the deadline."""
        inbox = self._inbox if one_sided else None
        socks = [s for s in self.sockets() if one_sided or s is not self.server]
        socks += [inbox.sock] if inbox is not None else []
        if not socks:
            return
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while (left := deadline - time.perf_counter()) > 1e-3:
            events = dict(poller.poll(max(1, int(left * 1000))))
            if inbox is not None and inbox.sock in events:
                inbox.take_handover(self.on_message)
                for sock in self._peers.values():  # a pull started now lands here too
                    poller.register(sock, zmq.POLLIN)
            if events:
                self.on_events(events)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose input `on_events` serves."""
        server = [self.server] if self.server is not None else []
        return server + list(self._peers.values())

    def on_events(self, events: dict[Any, int]) -> None:
        """Serve the readable ones among this transfer's sockets (a poll's result)."""
        if self.server is not None and self.server in events:
            self.on_readable()
        for endpoint, sock in list(self._peers.items()):
            if sock in events:
                self._on_replies(endpoint, sock)

    def handles(self, msg: Any) -> bool:
        """Whether `msg` (from the scheduler) is one of the hand-over's."""
        return isinstance(msg, (GrantLease, EndLease, PullKv))

    def on_message(self, msg: Any) -> None:
        """A hand-over message from the scheduler (a PullKv's answer comes later, from
        `take_answers`)."""
        if isinstance(msg, GrantLease):
            self._leases[msg.lease_id] = (msg.generation, list(msg.block_ids))
            self._max_granted = max(self._max_granted, msg.lease_id)
            self._retry_deferred()
        elif isinstance(msg, EndLease):
            self._leases.pop(msg.lease_id, None)
        else:
            self._start_pull(msg)

    def tick(self, now: float, frames_waiting: bool = False) -> None:
        """Called every loop turn (`now`: time.monotonic()): reads that waited for their grant
        past their time are refused, unless scheduler frames wait unread (`frames_waiting`:
        the grant may be among them, held up by a long step); pulls past their time-out fail;
        landed ones are answered."""
        if not frames_waiting:
            late = [d for d in self._deferred if d[2] <= now]
            self._deferred = [d for d in self._deferred if d[2] > now]
            for ident, msg, _ in late:
                self._answer(ident, msg, now)
        if self._pulls:
            self._end_pulls(time.perf_counter())

    def wait_ms(self, longest_ms: int) -> int:
        """How long the loop may wait for input before `tick` has work: at most `longest_ms`."""
        if not self._pulls and not self._deferred:
            return longest_ms
        now, mono = time.perf_counter(), time.monotonic()
        due = [p.landed_at if p.landed_at is not None else p.deadline for p in self._pulls]
        left = [t - now for t in due] + [d[2] - mono for d in self._deferred]
        return max(0, min(longest_ms, int(min(left) * 1000) + 1))

    def take_answers(self) -> list[KvPulled]:
        """The pulls that ended since the last call, for the scheduler (any order)."""
        out, self._answers = self._answers, []
        return out

    def num_pulling(self) -> int:
        return len(self._pulls)

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
                self._refuse(ident, None, exc.code, exc.message)
                continue
            if not isinstance(msg, KvRead):
                self._refuse(ident, None, "unexpected_type", type(msg).__name__)
                continue
            self._answer(ident, msg, now + GRANT_WAIT_S)

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
            self._refuse(ident, msg, LEASE_UNKNOWN, message)
            return
        heads, held = None, self._pool.num_kv_heads
        if msg.head_start is not None and msg.num_heads is not None:  # a slice: re-sharding
            heads = (msg.head_start, msg.head_start + msg.num_heads)
            if held is None or heads[1] > held:
                self._refuse(ident, msg, BAD_HEADS, f"heads {heads} of a rank with {held}")
                return
        assert self.server is not None
        out = self._pool.export(lease[1], heads)
        head = KvReadReply(True, shape=out.shape, dtype=out.dtype, lease_id=msg.lease_id,
                           generation=msg.generation)  # fmt: skip
        self.server.send_multipart([ident, encode(head), out.payload], copy=False)

    def _retry_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        for ident, msg, wait_until in waiting:
            self._answer(ident, msg, wait_until)

    def _refuse(self, ident: bytes, read: Optional[KvRead], code: str, message: str) -> None:
        self._log.warning("kv_read_refused", code=code, message=message)
        assert self.server is not None
        lease_id = read.lease_id if read is not None else None
        generation = read.generation if read is not None else None
        reply = KvReadReply(False, code, message, lease_id=lease_id, generation=generation)
        self.server.send_multipart([ident, encode(reply)])

    # ---- decode side -------------------------------------------------------------------------

    def _start_pull(self, msg: PullKv) -> None:
        """Send the reads of `msg.source` to the prefill ranks holding our heads of it; their
        answers are served by `on_events` as they land (or the pull fails at its time-out,
        `tick`)."""
        src = msg.source
        reads = shard_reads(src.kv_endpoint, self._rank, self._world_size,
                            self._pool.num_kv_heads)  # fmt: skip
        if reads is None:
            message = (
                f"the prefill worker serves {len(src.kv_endpoint.split())} tensor-parallel"
                f" rank(s) ({src.kv_endpoint}), this worker has {self._world_size} with "
                f"{self._pool.num_kv_heads} KV heads each: not re-shardable; recomputed"
            )
            self._log.error("kv_pull_refused", rid=msg.rid, code=TP_MISMATCH, message=message)
            self._answers.append(self._failed(msg, TP_MISMATCH, message))
            return
        keys = [(r.endpoint, src.lease_id, src.generation) for r in reads]
        if any(key in self._reads for key in keys):  # the same lease twice: not told apart
            self._answers.append(self._failed(msg, "duplicate_pull", "already pulling it"))
            return
        began = time.perf_counter()
        pull = _Pull(msg, began, began + self._pull_timeout_s, keys, len(reads))
        self._pulls.append(pull)
        for key, read in zip(keys, reads, strict=True):
            self._reads[key] = (pull, read)
            ask = KvRead(src.lease_id, src.generation, read.head_start, read.num_heads)
            self._peer(read.endpoint).send(encode(ask))

    def _on_replies(self, endpoint: str, sock: zmq.Socket) -> None:
        """Every answer waiting on one pull connection, each to the read it answers (an
        answer no read waits for, late after its pull's end, or naming no read, is dropped)."""
        while sock.poll(0, zmq.POLLIN):
            parts = sock.recv_multipart(copy=False)
            try:
                head = decode(parts[0].buffer)
            except DecodeError as exc:
                self._log.warning("kv_reply_dropped", code=exc.code, message=exc.message)
                continue
            found = None
            named = isinstance(head, KvReadReply) and head.generation is not None
            if named and head.lease_id is not None:
                key = (endpoint, head.lease_id, head.generation)
                found = self._reads.pop(key, None)
            if found is None:
                self._log.warning("kv_reply_dropped", code="no_pull", endpoint=endpoint)
                continue
            self._land(found[0], found[1], head, parts)

    def _land(self, pull: _Pull, read: ShardRead, head: KvReadReply, parts: list) -> None:
        """One read's answer: loaded into the pull's blocks (the pull reported once all its
        reads landed), or the pull's failure."""
        msg = pull.msg
        if not head.ok or len(parts) != 2:
            self._drop(pull)
            self._answers.append(self._failed(msg, head.code or "bad_reply", head.message))
            return
        try:
            pull.num_bytes += self._pool.load(msg.block_ids, head.shape, head.dtype,
                                              parts[1].buffer, read.dest_head_start)  # fmt: skip
        except KvLayoutError as exc:
            self._drop(pull)
            self._answers.append(self._failed(msg, "kv_layout_mismatch", str(exc)))
            return
        pull.num_left -= 1
        if pull.num_left == 0:
            now = time.perf_counter()
            landing = self._pool.landing_seconds(len(msg.block_ids), head.shape)
            pull.landed_at = now + landing
            self._end_pulls(now)

    def _drop(self, pull: _Pull) -> None:
        """`pull` ends: its reads still out are no longer waited for."""
        self._pulls.remove(pull)
        for key in pull.keys:
            self._reads.pop(key, None)

    def _end_pulls(self, now: float) -> None:
        """Answer the pulls that landed by `now`; fail those past their time-out unanswered."""
        for pull in list(self._pulls):
            msg = pull.msg
            if pull.landed_at is not None and pull.landed_at <= now:
                self._drop(pull)
                seconds = now - pull.began
                self._log.info("kv_pulled", rid=msg.rid, num_blocks=len(msg.block_ids),
                               num_bytes=pull.num_bytes, seconds=seconds,
                               source=msg.source.kv_endpoint, num_reads=len(pull.keys))  # fmt: skip
                done = KvPulled(msg.rid, True, pull.num_bytes, seconds, rank=self._rank,
                                world_size=self._world_size)  # fmt: skip
                self._answers.append(done)
            elif pull.landed_at is None and pull.deadline <= now:
                self._drop(pull)
                waiting = " ".join(k[0] for k in pull.keys)
                self._answers.append(self._failed(msg, "timeout", f"no answer from {waiting}"))

    def _failed(self, msg: PullKv, code: str, message: str) -> KvPulled:
        self._log.warning("kv_pull_failed", rid=msg.rid, code=code, message=message)
        return KvPulled(msg.rid, False, code=code, message=message, rank=self._rank,
                        world_size=self._world_size)  # fmt: skip

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
            for poller in self._pollers:
                poller.register(sock, zmq.POLLIN)
        return sock

    def close(self) -> None:
        """Called once when the loop ends."""
        for sock in self._peers.values():
            for poller in self._pollers:
                poller.unregister(sock)
            sock.close()
        self._peers.clear()
        if self.server is not None:
            self.server.close()
        stop_authenticator(self._auth)
