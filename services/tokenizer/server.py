"""The frontend's loop: clients (client_link.py) on one side, one or more engines
(engine_link.py, one per scheduler address) on the other, a router (router.py) between.

One thread, blocking on a zmq.Poller with a timeout (never busy-polling). Each turn: route each
engine's outputs to their clients, serve client messages, then housekeeping (FrontendHello
heartbeats, client heartbeats, engine liveness, query time-outs, drain).

Each request runs on one engine, chosen when it arrives. An engine that is lost (its scheduler
closed the connection, said EngineShutdown, or was silent for `scheduler_timeout_s`) leaves the
rotation at once; its requests that have not streamed a token yet are resubmitted to another
ready engine, the others end with `engine_unreachable` (docs/protocol.md). It rejoins when its
scheduler answers a heartbeat with EngineReady again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import zmq

from services.tokenizer.admission import Rejection, over_connection_cap, prompt_ids
from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.engine_queries import (
    RESET_PREFIX_CACHE,
    STATS,
    PendingQueries,
    PendingQuery,
    reset_reply,
    stats_reply,
)
from services.tokenizer.latency_window import LatencyWindow
from services.tokenizer.output_path import OutputPath
from services.tokenizer.request_state import ClientRequest, RequestTable
from services.tokenizer.router import Router
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.text_codec import TextCodec
from shared.protocol import client_channel as cc
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import (
    AbortRequest,
    EngineNotReady,
    EngineReady,
    EngineShutdown,
    FrontendBye,
    OutputBatch,
    PrefixCacheReset,
    RequestRejected,
    StatsReply,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.transport import Drain, guarded, one_turn

# Receive turns are bounded (shared/transport.py): a backlog of output batches must not delay
# the FrontendHello that keeps a scheduler from declaring this frontend gone.


class FrontendServer(OutputPath):
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
        self._clients = ClientLink(config, ctx, log, self._client_gone)
        self._engines = [
            EngineLink(i, addr, config.frontend_id, ctx, self._scheduler_gone, config.curve_keys)
            for i, addr in enumerate(config.scheduler_addresses)
        ]
        self._router = Router(config.router, len(self._engines))
        self._opened = False
        self._table = RequestTable()
        self._requests = self._table.by_rid  # rid -> state (the table's own dict)
        self._queries = PendingQueries(config.frontend_id, config.stats_timeout_s)
        self._next_seq = 0
        self._num_requests_total = 0
        self._num_resubmitted_total = 0
        self._latency = LatencyWindow()  # TTFT/TPOT of the last minute, for `stats`
        self._drain = Drain(config.drain_timeout_s, self.log)
        self._stopped = False
        self._handlers: dict[type, Callable[[EngineLink, Any], None]] = {
            OutputBatch: self._on_outputs,
            RequestRejected: self._on_rejected,
            EngineReady: self._on_ready,
            EngineNotReady: self._on_not_ready,
            EngineShutdown: self._on_shutdown,
            StatsReply: lambda link, m: self._answer(m.query_id, link.index, m.stats),
            PrefixCacheReset: lambda link, m: self._answer(
                m.query_id, link.index, m.num_blocks_dropped
            ),
        }

    # ---- life cycle --------------------------------------------------------------------------

    def open(self) -> None:
        self._clients.bind()
        now = time.monotonic()
        for link in self._engines:
            link.connect(now)
        self._opened = True
        self.log.info(
            "frontend_listening",
            address=self.config.frontend_address,
            schedulers=list(self.config.scheduler_addresses),
            router_policy=self.config.router.policy,
            frontend_id=self.config.frontend_id,
        )

    def request_drain(self) -> None:
        self._drain.request()

    def run(self) -> int:
        """Serve until drained; returns the process exit code."""
        if not self._opened:
            self.open()
        poller = zmq.Poller()
        poller.register(self._clients.socket, zmq.POLLIN)
        for link in self._engines:
            poller.register(link.socket, zmq.POLLIN)
            poller.register(link.watch.monitor, zmq.POLLIN)
        tick_ms = int(self.config.heartbeat_s * 500)  # housekeeping at twice the heartbeat rate
        while not self._stopped:
            events = dict(poller.poll(tick_ms))
            for link in self._engines:
                if link.socket in events:
                    self._on_engine(link)
            if self._clients.socket in events:
                self._clients.serve_turn(self._on_command)
            for link in self._engines:
                if link.watch.monitor in events:
                    link.on_monitor(self.log)
            self._housekeeping(time.monotonic())
        self._clients.close()
        for link in self._engines:
            link.close()
        self.log.info("frontend_stopped")
        return 0

    # ---- client side -------------------------------------------------------------------------

    def _on_command(self, ident: bytes, cmd: cc.ClientCommand) -> None:
        if isinstance(cmd, cc.GenerateCommand):
            self._on_generate(ident, cmd)
        elif isinstance(cmd, cc.AbortCommand):
            self._on_abort(ident, cmd.id)
        elif isinstance(cmd, cc.HealthCommand):
            self._on_health(ident, cmd.id)
        elif isinstance(cmd, cc.ResetPrefixCacheCommand):
            self._on_query(ident, cmd.id, RESET_PREFIX_CACHE)
        else:
            self._on_query(ident, cmd.id, STATS)

    def _on_health(self, ident: bytes, client_id: Optional[str]) -> None:
        engine = self._reference_engine()
        loads = self._router.loads
        engines = [link.health(loads[i].estimate(), loads[i].kv_usage)
                   for i, link in enumerate(self._engines)]  # fmt: skip
        self._clients.send(ident, cc.health_reply(
            client_id, self._ready(), self._reason(), engine.model_name if engine else None,
            engine.max_model_len if engine else None, engine.vocab_size if engine else None,
            self.config.frontend_id, engines,
        ))  # fmt: skip

    def _on_generate(self, ident: bytes, cmd: cc.GenerateCommand) -> None:
        now = time.monotonic()
        checked = self._admit(ident, cmd)
        if isinstance(checked, Rejection):
            self._clients.reply_error(ident, checked.code, checked.message, cmd.id)
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
            submit=SubmitRequest(rid, checked, cmd.sampling, cmd.priority, time.time()),
        )
        if not self._submit(state, exclude=None):
            msg = "no scheduler is connected"
            self._clients.reply_error(ident, ErrorCode.ENGINE_UNREACHABLE, msg, cmd.id)
            return
        self._table.add(state)
        self._num_requests_total += 1
        self.log.info(
            "request_received", rid=rid, client_id=cmd.id, num_prompt_tokens=len(checked),
            max_tokens=cmd.sampling.max_tokens, stream=cmd.stream, num_stop=len(cmd.stop),
            engine=self._engines[state.engine].name,
        )  # fmt: skip

    def _submit(self, state: ClientRequest, exclude: Optional[int]) -> bool:
        """Send the request to the engine the router picks among the ready ones (not
        `exclude`); an engine whose send fails is skipped. False when none took it."""
        if state.submit is None:  # only requests made here carry one; all of them do
            return False
        ids = state.submit.prompt_token_ids
        ready = [i for i, link in enumerate(self._engines) if link.ready and i != exclude]
        frame = encode(state.submit)
        while ready:
            engine = self._router.choose(ids, ready)
            if engine is None:
                return False
            if self._engines[engine].send(frame):
                self._router.routed(engine, ids)
                state.engine = engine
                return True
            ready.remove(engine)
        return False

    def _admit(self, ident: bytes, cmd: cc.GenerateCommand) -> list[int] | Rejection:
        """Prompt ids, or the first reason (in the documented order) to refuse the request."""
        if self._table.rid_of(ident, cmd.id) is not None:
            return Rejection(ErrorCode.DUPLICATE_ID, f"id {cmd.id!r} is already in flight")
        if self._drain.requested:
            return Rejection(ErrorCode.SHUTTING_DOWN, "the frontend is shutting down")
        engine = self._reference_engine()
        if engine is None:
            return Rejection(ErrorCode.NOT_READY, f"the engine is not ready ({self._reason()})")
        if not ident.startswith(self.config.cap_exempt_prefix.encode()):
            cap = self.config.max_requests_per_connection
            if (over := over_connection_cap(self._table.num_on(ident), cap)) is not None:
                return over
        return prompt_ids(cmd, self.codec, engine)

    def _on_abort(self, ident: bytes, client_id: str) -> None:
        rid = self._table.rid_of(ident, client_id)
        if rid is None:
            self._clients.send(ident, cc.aborted_reply(client_id, False))
            return
        state = self._forget(rid)
        self._engines[state.engine].send(encode(AbortRequest(rid, "abort")))
        self.log.info("request_aborted", rid=rid, client_id=client_id, reason="client")
        for frame in [*state.abort(time.monotonic()), cc.aborted_reply(client_id, True)]:
            if not self._clients.send(ident, frame):
                return

    def _on_query(self, ident: bytes, client_id: Optional[str], kind: str) -> None:
        """A query every engine answers (engine_queries.py): sent to each connected one;
        unanswered, the time-out replies with what came."""
        msg = self._queries.message(kind)
        frame = encode(msg)
        asked = [link.index for link in self._engines if link.send(frame)]
        query = self._queries.open(msg.query_id, ident, client_id, kind, time.monotonic(), asked)
        if not asked:
            self._reply_query(query)

    def _answer(self, qid: str, engine: int, value: Any) -> None:
        query = self._queries.answer(qid, engine, value)
        if query is not None:
            self._reply_query(query)

    def _reply_query(self, query: PendingQuery) -> None:
        names = [link.name for link in self._engines]
        if query.kind == RESET_PREFIX_CACHE:
            reply = reset_reply(query, names)
        else:
            reply = stats_reply(query, names, self._ready(), self._frontend_stats())
        self._clients.send(query.identity, reply)

    def _frontend_stats(self) -> dict[str, float]:
        connections = {state.identity for state in self._requests.values()}
        return {
            "requests_in_flight": float(len(self._requests)),
            "connections": float(len(connections)),
            "requests_total": float(self._num_requests_total),
            "errors_total": float(self._clients.num_errors_total),
            "requests_resubmitted_total": float(self._num_resubmitted_total),
            "num_engines": float(len(self._engines)),
            "num_engines_ready": float(sum(link.ready is not None for link in self._engines)),
            **self._latency.percentiles(time.monotonic()),
        }

    def _client_gone(self, ident: bytes, reason: str) -> None:
        for rid in self._table.rids_of(ident):
            state = self._forget(rid)
            self._engines[state.engine].send(encode(AbortRequest(rid, "client_gone")))
            self.log.info("request_aborted", rid=rid, reason="client_gone", detail=reason)

    def _forget(self, rid: str) -> ClientRequest:
        state = self._table.pop(rid)
        self._router.request_done(state.engine)
        return state

    # ---- engine side -------------------------------------------------------------------------

    def _on_engine(self, link: EngineLink) -> None:
        for parts in one_turn(link.socket):
            guarded(self.log, "scheduler_message_failed",
                    lambda frame: self._on_engine_frame(link, frame), parts[-1])  # fmt: skip

    def _on_engine_frame(self, link: EngineLink, frame: bytes) -> None:
        """One scheduler message (it sends one frame each); a bad one is a logged drop."""
        link.last_rx = time.monotonic()
        try:
            msg = decode(frame)
        except DecodeError as exc:
            self.log.warning("bad_scheduler_frame", engine=link.name, code=exc.code,
                             message=exc.message)  # fmt: skip
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.log.warning("unexpected_scheduler_message", engine=link.name,
                             type=type(msg).__name__)  # fmt: skip
            return
        handler(link, msg)

    def _scheduler_gone(self, index: int) -> None:
        msg = "the connection to the scheduler was lost"
        self._engine_lost(self._engines[index], "scheduler_unreachable", msg)

    def _on_rejected(self, link: EngineLink, msg: RequestRejected) -> None:
        state = self._requests.get(msg.rid)
        if state is not None and state.engine == link.index:
            self._forget(msg.rid)
            self.log.info("request_rejected", rid=msg.rid, code=msg.code, engine=link.name)
            self._clients.num_errors_total += 1
            self._clients.send(state.identity, state.error(msg.code, msg.message))

    def _on_ready(self, link: EngineLink, msg: EngineReady) -> None:
        if link.ready is None:
            self.log.info(
                "engine_ready", engine=link.name, address=link.address, model=msg.model_name,
                max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
            )  # fmt: skip
        link.ready, link.ever_ready = msg, True
        self._router.on_report(link.index, msg.num_waiting, msg.num_running, msg.kv_usage)
        self._router.prefix_caching = all(
            e.ready.prefix_caching for e in self._engines if e.ready is not None
        )

    def _on_not_ready(self, link: EngineLink, msg: EngineNotReady) -> None:
        # New requests go elsewhere until the worker is back; those in flight stay: the
        # scheduler restarts them by recompute, or ends them itself (worker_failed).
        if link.ready is not None:
            self.log.warning("engine_not_ready", engine=link.name, reason=msg.reason)
        link.ready = None
        link.not_ready_reason = "worker_lost" if link.ever_ready else "waiting_for_worker"

    def _on_shutdown(self, link: EngineLink, msg: EngineShutdown) -> None:
        self._engine_lost(link, "scheduler_unreachable", f"the scheduler stopped: {msg.reason}")

    def _engine_lost(self, link: EngineLink, reason: str, message: str) -> None:
        """Out of rotation; its requests that streamed nothing yet run on another ready engine,
        the others end with `engine_unreachable`."""
        mine = [rid for rid, state in self._requests.items() if state.engine == link.index]
        if link.ready is None and not mine and link.not_ready_reason == reason:
            return  # lost already (the silence check repeats every tick)
        if link.ready is not None or mine:
            self.log.warning("engine_lost", engine=link.name, reason=reason, detail=message,
                             num_in_flight=len(mine))  # fmt: skip
        link.ready = None
        link.not_ready_reason = reason
        self._router.engine_lost(link.index)
        for rid in mine:
            state = self._requests.get(rid)
            if state is None:
                continue  # a failed send already dropped it with its connection
            link.send(encode(AbortRequest(rid, "engine_lost")))  # a hung one may wake up
            if state.streamed_nothing() and self._submit(state, exclude=link.index):
                self._router.request_done(link.index)
                self._num_resubmitted_total += 1
                self.log.info("request_resubmitted", rid=rid, from_engine=link.name,
                              engine=self._engines[state.engine].name)  # fmt: skip
                continue
            self._forget(rid)
            self._clients.num_errors_total += 1
            self.log.info("request_failed", rid=rid, code=ErrorCode.ENGINE_UNREACHABLE,
                          engine=link.name)  # fmt: skip
            self._clients.send(state.identity, state.error(ErrorCode.ENGINE_UNREACHABLE, message))

    # ---- state -------------------------------------------------------------------------------

    def _reference_engine(self) -> Optional[EngineReady]:
        """A ready engine's handshake (the first): the model's limits for admission. Engines
        behind one frontend serve the same model."""
        return next((link.ready for link in self._engines if link.ready is not None), None)

    def _ready(self) -> bool:
        return self._reference_engine() is not None and not self._drain.requested

    def _reason(self) -> Optional[str]:
        if self._drain.requested:
            return "shutting_down"
        if self._reference_engine() is not None:
            return None
        return self._engines[0].not_ready_reason

    # ---- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        cfg = self.config
        for link in self._engines:
            link.hello(now, cfg.heartbeat_s)
            if link.silent_for(now) > cfg.scheduler_timeout_s:
                msg = f"no word from the scheduler for {cfg.scheduler_timeout_s:g} s"
                self._engine_lost(link, "scheduler_unreachable", msg)
        self._clients.heartbeat((state.identity for state in self._requests.values()), now)
        for query in self._queries.expired(now):
            self._reply_query(query)
        self._drain_step(now)

    def _drain_step(self, now: float) -> None:
        if not self._drain.due(now, len(self._requests)):
            return
        for rid in list(self._requests):
            if rid not in self._requests:
                continue
            state = self._forget(rid)
            self.log.info("request_failed", rid=rid, code=ErrorCode.SHUTTING_DOWN)
            self._engines[state.engine].send(encode(AbortRequest(rid, "shutdown")))
            msg = "the frontend stopped before the request finished"
            self._clients.send(state.identity, state.error(ErrorCode.SHUTTING_DOWN, msg))
        for link in self._engines:
            link.send(encode(FrontendBye(self.config.frontend_id)))
        self._stopped = True
