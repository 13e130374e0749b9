"""The frontend's loop: clients (ROUTER) on one side, the scheduler (DEALER) on the other.

One thread, blocking on a zmq.Poller with a timeout (never busy-polling). Each turn: route the
scheduler's outputs to their clients, serve client messages, then housekeeping (FrontendHello
heartbeat, client heartbeats, scheduler liveness, stats time-outs, drain).

Clients that vanish are found by ROUTER_MANDATORY: a reply or a heartbeat that cannot be routed
fails, and every request of that connection is aborted in the scheduler.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional

import zmq

from services.tokenizer.admission import Rejection, over_connection_cap, prompt_ids
from services.tokenizer.config import FrontendConfig
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.engine_queries import RESET_PREFIX_CACHE, STATS, PendingQueries
from services.tokenizer.latency_window import LatencyWindow
from services.tokenizer.request_state import ClientRequest, Progress
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.text_codec import TextCodec
from shared.curve import make_curve_server, make_frontend_curve_client
from shared.protocol import client_channel as cc
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import (
    AbortRequest,
    EngineNotReady,
    EngineReady,
    EngineShutdown,
    FrontendBye,
    FrontendHello,
    OutputBatch,
    PrefixCacheReset,
    RequestRejected,
    RequestTimings,
    StatsReply,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.transport import DisconnectWatch, guarded, one_turn

# Receive turns are bounded (shared/transport.py): a backlog of output batches must not delay
# the FrontendHello that keeps the scheduler from declaring this frontend gone.


class FrontendServer:
    """Call `open()` (binds; raises zmq.ZMQError), then `run()` until drained.

    `request_drain()` only sets a flag, so it is safe from a signal handler."""

    def __init__(
        self,
        config: FrontendConfig,
        codec: TextCodec,
        log: Any,
        context: Optional[zmq.Context] = None,
    ) -> None:
        self.config = config
        self.codec = codec
        self.log = log
        ctx = context or zmq.Context.instance()
        self._clients = ctx.socket(zmq.ROUTER)
        self._sched = ctx.socket(zmq.DEALER)
        self._opened = False
        self._requests: dict[str, ClientRequest] = {}  # rid -> state
        self._by_client: dict[tuple[bytes, str], str] = {}  # (identity, client id) -> rid
        self._num_per_conn: Counter[bytes] = Counter()  # identity -> requests in flight
        self._last_tx: dict[bytes, float] = {}  # identity -> last frame sent (heartbeats)
        self._queries = PendingQueries(config.frontend_id, config.stats_timeout_s)
        self._engine: Optional[EngineReady] = None
        self._ever_ready = False
        self._not_ready_reason = "waiting_for_worker"
        self._last_engine_rx = time.monotonic()
        self._last_hello = float("-inf")
        self._next_seq = 0
        self._num_requests_total = 0
        self._num_errors_total = 0
        self._latency = LatencyWindow()  # TTFT/TPOT of the last minute, for `stats`
        self._drain_requested = False
        self._draining_since: Optional[float] = None
        self._stopped = False

    # ---- life cycle --------------------------------------------------------------------------

    def open(self) -> None:
        clients, sched = self._clients, self._sched
        clients.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable reply -> error: client gone
        clients.setsockopt(zmq.MAXMSGSIZE, self.config.hard_cap_bytes)
        clients.setsockopt(zmq.SNDHWM, self.config.send_hwm)
        clients.setsockopt(zmq.LINGER, 500)
        make_curve_server(clients, self.config.curve_keys, self.log)  # ZAP: see __main__
        make_frontend_curve_client(sched, self.config.curve_keys)  # authorized_frontends/
        sched.setsockopt(zmq.IDENTITY, self.config.frontend_id.encode())
        sched.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a scheduler not there
        sched.setsockopt(zmq.LINGER, 1000)
        # A scheduler that dies closes the connection: its requests are lost at once (they
        # would otherwise wait forever once a restarted scheduler keeps the link alive). A hung
        # one is found by the silence time-out instead.
        self._sched_watch = DisconnectWatch(sched, self._scheduler_gone)
        try:
            clients.bind(self.config.frontend_address)
        except zmq.ZMQError:
            clients.close(0)
            self._sched_watch.close()
            sched.close(0)
            raise
        sched.connect(self.config.scheduler_address)
        self._opened = True
        self.log.info(
            "frontend_listening",
            address=self.config.frontend_address,
            scheduler=self.config.scheduler_address,
            frontend_id=self.config.frontend_id,
        )

    def request_drain(self) -> None:
        self._drain_requested = True

    def run(self) -> int:
        """Serve until drained; returns the process exit code."""
        if not self._opened:
            self.open()
        clients, sched = self._clients, self._sched
        poller = zmq.Poller()
        poller.register(clients, zmq.POLLIN)
        poller.register(sched, zmq.POLLIN)
        poller.register(self._sched_watch.monitor, zmq.POLLIN)
        tick_ms = int(self.config.heartbeat_s * 500)  # housekeeping at twice the heartbeat rate
        while not self._stopped:
            events = dict(poller.poll(tick_ms))
            if sched in events:
                self._on_scheduler()
            if clients in events:
                self._on_clients()
            if self._sched_watch.monitor in events:
                guarded(
                    self.log, "monitor_event_failed", lambda _: self._sched_watch.on_events(), 0
                )
            self._housekeeping(time.monotonic())
        clients.close()
        self._sched_watch.close()
        sched.close()
        self.log.info("frontend_stopped")
        return 0

    # ---- client side -------------------------------------------------------------------------

    def _on_clients(self) -> None:
        for parts in one_turn(self._clients):
            guarded(self.log, "client_message_failed", self._on_client_message, parts,
                    lambda _exc, parts=parts: self._internal_error(parts))  # fmt: skip

    def _internal_error(self, parts: list[bytes]) -> None:
        msg = "the frontend failed on this message (logged)"
        self._reply_error(parts[0], ErrorCode.INTERNAL, msg, cc.peek_id(parts[-1]))

    def _on_client_message(self, parts: list[bytes]) -> None:
        """One client message: a DEALER's [identity, frame]. Called inside the boundary."""
        ident = parts[0]
        if len(parts) != 2:
            msg = "send exactly one frame per message from a DEALER socket"
            self._reply_error(ident, ErrorCode.MALFORMED_MESSAGE, msg, None)
            return
        try:
            cmd = cc.decode_client_message(parts[1], self.config.max_frame_bytes)
        except cc.ClientMessageError as exc:
            self._reply_error(ident, exc.code, exc.message, exc.id)
            return
        self._on_command(ident, cmd)

    def _on_command(self, ident: bytes, cmd: cc.ClientCommand) -> None:
        if isinstance(cmd, cc.GenerateCommand):
            self._on_generate(ident, cmd)
        elif isinstance(cmd, cc.AbortCommand):
            self._on_abort(ident, cmd.id)
        elif isinstance(cmd, cc.HealthCommand):
            ready = self._ready()
            engine = self._engine
            self._send_client(ident, cc.health_reply(
                cmd.id, ready, self._reason(), engine.model_name if engine else None,
                engine.max_model_len if engine else None, engine.vocab_size if engine else None,
                self.config.frontend_id,
            ))  # fmt: skip
        elif isinstance(cmd, cc.ResetPrefixCacheCommand):
            self._on_stats(ident, cmd.id, RESET_PREFIX_CACHE)
        else:
            self._on_stats(ident, cmd.id)

    def _on_generate(self, ident: bytes, cmd: cc.GenerateCommand) -> None:
        now = time.monotonic()
        checked = self._admit(ident, cmd)
        if isinstance(checked, Rejection):
            self._reply_error(ident, checked.code, checked.message, cmd.id)
            return
        rid = f"{self.config.frontend_id}-{self._next_seq}"
        self._next_seq += 1
        state = ClientRequest(
            rid=rid,
            client_id=cmd.id,
            identity=ident,
            stream=cmd.stream,
            sampling=cmd.sampling,
            num_prompt_tokens=len(checked),
            detokenizer=IncrementalDetokenizer(self.codec.decode, checked),
            stops=StopStrings(cmd.stop),
            received_at=now,
        )
        submit = SubmitRequest(rid, checked, cmd.sampling, cmd.priority, time.time())
        if not self._send_scheduler(encode(submit)):
            msg = "the scheduler is not connected"
            self._reply_error(ident, ErrorCode.ENGINE_UNREACHABLE, msg, cmd.id)
            return
        self._requests[rid] = state
        self._by_client[(ident, cmd.id)] = rid
        self._num_per_conn[ident] += 1
        self._num_requests_total += 1
        self.log.info(
            "request_received", rid=rid, client_id=cmd.id, num_prompt_tokens=len(checked),
            max_tokens=cmd.sampling.max_tokens, stream=cmd.stream, num_stop=len(cmd.stop),
        )  # fmt: skip

    def _admit(self, ident: bytes, cmd: cc.GenerateCommand) -> list[int] | Rejection:
        """Prompt ids, or the first reason (in the documented order) to refuse the request."""
        if (ident, cmd.id) in self._by_client:
            return Rejection(ErrorCode.DUPLICATE_ID, f"id {cmd.id!r} is already in flight")
        if self._draining_since is not None or self._drain_requested:
            return Rejection(ErrorCode.SHUTTING_DOWN, "the frontend is shutting down")
        if self._engine is None:
            return Rejection(ErrorCode.NOT_READY, f"the engine is not ready ({self._reason()})")
        if not ident.startswith(self.config.cap_exempt_prefix.encode()):
            cap = self.config.max_requests_per_connection
            if (over := over_connection_cap(self._num_per_conn[ident], cap)) is not None:
                return over
        return prompt_ids(cmd, self.codec, self._engine)

    def _on_abort(self, ident: bytes, client_id: str) -> None:
        rid = self._by_client.get((ident, client_id))
        if rid is None:
            self._send_client(ident, cc.aborted_reply(client_id, False))
            return
        state = self._forget(rid)
        self._send_scheduler(encode(AbortRequest(rid, "abort")))
        self.log.info("request_aborted", rid=rid, client_id=client_id, reason="client")
        for frame in [*state.abort(time.monotonic()), cc.aborted_reply(client_id, True)]:
            if not self._send_client(ident, frame):
                return

    def _on_stats(self, ident: bytes, client_id: Optional[str], kind: str = STATS) -> None:
        """A query the scheduler answers (engine_queries.py); unanswered, the time-out replies."""
        query = self._queries.open(ident, client_id, kind, time.monotonic())
        self._send_scheduler(encode(query))

    def _answer_reset(self, qid: str, num_blocks_dropped: Optional[int]) -> None:
        wait = self._queries.take(qid)
        if wait is None:
            return
        if num_blocks_dropped is None:
            msg = "the engine did not answer reset_prefix_cache in time"
            self._reply_error(wait.identity, ErrorCode.ENGINE_UNREACHABLE, msg, wait.client_id)
            return
        reply = cc.reset_prefix_cache_reply(wait.client_id, num_blocks_dropped)
        self._send_client(wait.identity, reply)

    def _answer_stats(self, qid: str, engine: Optional[dict[str, float]]) -> None:
        wait = self._queries.take(qid)
        if wait is None:
            return
        connections = {state.identity for state in self._requests.values()}
        frontend = {
            "requests_in_flight": float(len(self._requests)),
            "connections": float(len(connections)),
            "requests_total": float(self._num_requests_total),
            "errors_total": float(self._num_errors_total),
            **self._latency.percentiles(time.monotonic()),
        }
        reply = cc.stats_reply(wait.client_id, self._ready(), frontend, engine)
        self._send_client(wait.identity, reply)

    def _reply_error(self, ident: bytes, code: str, message: str, client_id: Optional[str]) -> None:
        self._num_errors_total += 1
        self.log.info("client_error", code=code, client_id=client_id, message=message)
        self._send_client(ident, cc.error_reply(code, message, client_id))

    def _send_client(self, ident: bytes, frame: bytes) -> bool:
        """False (and the client's requests aborted) when the client is gone."""
        sock = self._clients
        try:
            sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: disconnected; EAGAIN: not reading at all
            self._client_gone(ident, exc.strerror)
            return False
        self._last_tx[ident] = time.monotonic()
        return True

    def _client_gone(self, ident: bytes, reason: str) -> None:
        self._last_tx.pop(ident, None)
        rids = [rid for (owner, _), rid in self._by_client.items() if owner == ident]
        for rid in rids:
            self._forget(rid)
            self._send_scheduler(encode(AbortRequest(rid, "client_gone")))
            self.log.info("request_aborted", rid=rid, reason="client_gone", detail=reason)

    def _forget(self, rid: str) -> ClientRequest:
        state = self._requests.pop(rid)
        self._by_client.pop((state.identity, state.client_id), None)
        self._num_per_conn[state.identity] -= 1
        if self._num_per_conn[state.identity] <= 0:
            del self._num_per_conn[state.identity]
        return state

    # ---- scheduler side ----------------------------------------------------------------------

    def _on_scheduler(self) -> None:
        for parts in one_turn(self._sched):
            guarded(self.log, "scheduler_message_failed", self._on_scheduler_frame, parts[-1])

    def _on_scheduler_frame(self, frame: bytes) -> None:
        """One scheduler message (it sends one frame each); a bad one is a logged drop."""
        self._last_engine_rx = time.monotonic()
        try:
            msg = decode(frame)
        except DecodeError as exc:
            self.log.warning("bad_scheduler_frame", code=exc.code, message=exc.message)
            return
        self._on_engine_message(msg)

    def _scheduler_gone(self) -> None:
        if self._engine is not None or self._requests:
            msg = "the connection to the scheduler was lost"
            self._engine_lost("scheduler_unreachable", ErrorCode.ENGINE_UNREACHABLE, msg)

    def _on_engine_message(self, msg: Any) -> None:
        if isinstance(msg, OutputBatch):
            self._on_outputs(msg)
        elif isinstance(msg, RequestRejected):
            if msg.rid in self._requests:
                state = self._forget(msg.rid)
                self.log.info("request_rejected", rid=msg.rid, code=msg.code)
                self._num_errors_total += 1
                self._send_client(state.identity, state.error(msg.code, msg.message))
        elif isinstance(msg, EngineReady):
            if self._engine is None:
                self.log.info(
                    "engine_ready",
                    model=msg.model_name,
                    max_model_len=msg.max_model_len,
                    vocab_size=msg.vocab_size,
                )
            self._engine, self._ever_ready = msg, True
        elif isinstance(msg, EngineNotReady):
            # New requests are refused until the worker is back; those in flight stay: the
            # scheduler restarts them by recompute, or ends them itself (worker_failed).
            if self._engine is not None:
                self.log.warning("engine_not_ready", reason=msg.reason)
            self._engine = None
            self._not_ready_reason = "worker_lost" if self._ever_ready else "waiting_for_worker"
        elif isinstance(msg, EngineShutdown):
            self._engine_lost(
                "scheduler_unreachable",
                ErrorCode.ENGINE_UNREACHABLE,
                f"the scheduler stopped: {msg.reason}",
            )
        elif isinstance(msg, StatsReply):
            self._answer_stats(msg.query_id, msg.stats)
        elif isinstance(msg, PrefixCacheReset):
            self._answer_reset(msg.query_id, msg.num_blocks_dropped)
        else:
            self.log.warning("unexpected_scheduler_message", type=type(msg).__name__)

    def _on_outputs(self, batch: OutputBatch) -> None:
        """One step's outputs: first the tokens of requests that go on, then final outputs."""
        now = time.monotonic()
        logprobs = batch.logprobs
        for rid, token in zip(batch.rids, batch.token_ids, strict=True):
            state = self._requests.get(rid)
            if state is not None:  # else aborted or stopped here already
                lps = logprobs.get(rid) if logprobs else None
                self._deliver(rid, state, state.on_token(token, lps, now), None, now)
        for out in batch.finished:
            state = self._requests.get(out.rid)
            if state is not None:
                self._deliver(out.rid, state, state.on_output(out, now), out.timings, now)

    def _deliver(
        self,
        rid: str,
        state: ClientRequest,
        progress: Progress,
        engine_timings: Optional[RequestTimings],
        now: float,
    ) -> None:
        """Send a request's frames; when it finished here, forget it (and abort it in the
        engine if only a stop string ended it)."""
        if progress.finished:
            self._forget(rid)
            if progress.abort_in_engine:
                self._send_scheduler(encode(AbortRequest(rid, "stop_string")))
            timings = state.timings(engine_timings, now)
            self.log.info(
                "request_finished", rid=rid, finish_reason=progress.finish_reason,
                num_output_tokens=len(state.token_ids), ttft_s=timings.ttft_s,
                tpot_s=timings.tpot_s, e2e_s=timings.e2e_s, queue_s=timings.queue_s,
            )  # fmt: skip
            self._latency.record(now, timings.ttft_s, timings.tpot_s)
        for frame in progress.frames:
            if not self._send_client(state.identity, frame):
                break

    def _engine_lost(self, reason: str, code: str, message: str) -> None:
        """Not ready any more: every in-flight request ends with an error."""
        if self._engine is not None or self._requests:
            self.log.warning(
                "engine_not_ready", reason=reason, detail=message, num_failed=len(self._requests)
            )
        self._engine = None
        self._not_ready_reason = reason
        for rid in list(self._requests):
            if rid not in self._requests:
                continue  # a failed send already dropped it with its connection
            state = self._forget(rid)
            self._num_errors_total += 1
            self.log.info("request_failed", rid=rid, code=code)
            self._send_client(state.identity, state.error(code, message))

    def _send_scheduler(self, frame: bytes) -> bool:
        sock = self._sched
        try:
            sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: not connected (IMMEDIATE) or its queue is full
            return False
        return True

    # ---- state -------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self._engine is not None and not self._drain_requested

    def _reason(self) -> Optional[str]:
        if self._drain_requested:
            return "shutting_down"
        return None if self._engine is not None else self._not_ready_reason

    # ---- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        cfg = self.config
        if now - self._last_hello >= cfg.heartbeat_s:
            self._last_hello = now
            self._send_scheduler(encode(FrontendHello(cfg.frontend_id)))
        if now - self._last_engine_rx > cfg.scheduler_timeout_s:
            if self._engine is not None or self._requests:
                self._engine_lost(
                    "scheduler_unreachable",
                    ErrorCode.ENGINE_UNREACHABLE,
                    f"no word from the scheduler for {cfg.scheduler_timeout_s:g} s",
                )
            self._not_ready_reason = "scheduler_unreachable"
        self._heartbeat_clients(now)
        for qid, kind in self._queries.expired(now):
            (self._answer_stats if kind == STATS else self._answer_reset)(qid, None)
        self._drain_step(now)

    def _heartbeat_clients(self, now: float) -> None:
        """Any connection with a request in flight hears something at least every heartbeat_s;
        a send that fails means the client is gone."""
        active = {state.identity for state in self._requests.values()}
        self._last_tx = {i: t for i, t in self._last_tx.items() if i in active}
        for ident in active:
            if now - self._last_tx.get(ident, float("-inf")) >= self.config.heartbeat_s:
                self._send_client(ident, cc.heartbeat_reply())

    def _drain_step(self, now: float) -> None:
        if self._drain_requested and self._draining_since is None:
            self._draining_since = now
            self.log.info(
                "draining", num_in_flight=len(self._requests), grace_s=self.config.drain_timeout_s
            )
        if self._draining_since is None:
            return
        if self._requests and now - self._draining_since <= self.config.drain_timeout_s:
            return
        for rid in list(self._requests):
            if rid not in self._requests:
                continue
            state = self._forget(rid)
            self.log.info("request_failed", rid=rid, code=ErrorCode.SHUTTING_DOWN)
            self._send_scheduler(encode(AbortRequest(rid, "shutdown")))
            msg = "the frontend stopped before the request finished"
            self._send_client(state.identity, state.error(ErrorCode.SHUTTING_DOWN, msg))
        self._send_scheduler(encode(FrontendBye(self.config.frontend_id)))
        self._stopped = True
