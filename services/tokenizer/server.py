"""The frontend's loop: clients (client_link.py) on one side, one or more engines
(engines.py: one link per scheduler address and the router) on the other.

One thread, blocking on a zmq.Poller with a timeout (never busy-polling). Each turn: route each
engine's outputs to their clients, serve client messages, then housekeeping (FrontendHello
heartbeats, client heartbeats, engine liveness, query time-outs, drain).

The parts, each the one owner of its state (its own methods change it):

* `RequestTable` (request_table.py): the open requests; each `ClientRequest`
  (request_state.py) owns its text, tokens, timings and engine;
* `RequestFlow` (request_flow.py): opens and closes requests (admission, abort, client gone,
  engine refusal or loss, drain, shutdown), keeping the engines' counts in step;
* `Resumption` (resumption.py): moves a request to its next attempt on another engine (or
  the same one, restarted), and keeps those waiting for an engine;
* `OutputPath` (output_path.py): each step's outputs -> client frames; recent latencies;
* `Reports` (reports.py): health, stats and reset_prefix_cache, and the open queries;
* `Engines` / `ClientLink`: the sockets, the engines' readiness and the router.

This module only wires them: messages go to their handler through one table per side.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Optional

import zmq

from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.engines import Engines
from services.tokenizer.handovers import Handovers
from services.tokenizer.output_path import OutputPath
from services.tokenizer.reports import Reports
from services.tokenizer.request_flow import LOST, RequestFlow
from services.tokenizer.request_table import RequestTable
from services.tokenizer.resumption import Resumption
from services.tokenizer.text_codec import TextCodec
from shared.protocol import client_channel as cc
from shared.protocol.codec import DecodeError, decode
from shared.protocol.engine_channel import (
    EngineNotReady,
    EngineReady,
    EngineShutdown,
    HandoverDone,
    OutputBatch,
    PrefixCacheReset,
    RequestRejected,
    StatsReply,
)
from shared.tracing import Tracing
from shared.transport import Drain, guarded, one_turn

# Receive turns are bounded (shared/transport.py): a backlog of output batches must not delay
# the FrontendHello that keeps a scheduler from declaring this frontend gone.

ClientHandler = Callable[[bytes, Any], None]
EngineHandler = Callable[[EngineLink, Any], None]


class FrontendServer:
    """Call `open()` (binds; raises zmq.ZMQError), then `run()` until drained (or `turn()`
    repeatedly, as tests do, with `check_invariants()` between turns).

    `request_drain()` only sets a flag, so it is safe from a signal handler."""

    def __init__(
        self,
        config: FrontendConfig,
        codec: TextCodec,
        log: Any,
        context: Optional[zmq.Context] = None,
        tracing: Optional[Tracing] = None,
    ) -> None:
        """`tracing`: request spans (shared/tracing.py); None: tracing off."""
        self.config = config
        self.log = log
        ctx = context or zmq.Context.instance()
        # This process's identity towards the schedulers, and the start of its rids: the
        # configured id plus a suffix of its own, so a restarted frontend is a new peer whose
        # rids never meet those of the process it replaces (docs/design/resumption.md).
        self.identity = f"{config.frontend_id}.{secrets.token_hex(2)}"
        self._drain = Drain(config.drain_timeout_s, log)
        self._table = RequestTable()
        # The links report a lost peer to the request flow, made after them (it sends on them).
        self._clients = ClientLink(config, ctx, log, lambda i, r: self._flow.client_gone(i, r))
        self._engines = Engines(
            config, ctx, log, lambda e: self._flow.scheduler_gone(e), self.identity
        )
        # disaggregation's open leases (renewed every heartbeat)
        self._handovers = Handovers(self._engines, log, config.heartbeat_s)
        self._resumption = Resumption(
            config, self._table, self._engines, self._clients, log, self._handovers
        )
        self._flow = RequestFlow(
            config, codec, self._table, self._engines, self._clients, self._resumption,
            self._drain, log, f"{self.identity}-", self._handovers, tracing,
        )  # fmt: skip
        self._output = OutputPath(self._table, self._flow, self._engines, self._clients, log)
        self._reports = Reports(
            config, self._table, self._engines, self._clients, self._flow, self._resumption,
            self._output,
        )  # fmt: skip
        self._client_handlers: dict[type, ClientHandler] = {
            cc.GenerateCommand: self._flow.on_generate,
            cc.AbortCommand: self._flow.on_abort,
            cc.HealthCommand: self._reports.on_health,
            cc.StatsCommand: self._reports.on_stats,
            cc.ResetPrefixCacheCommand: self._reports.on_reset_prefix_cache,
            cc.DrainCommand: self._flow.on_drain,
        }
        self._engine_handlers: dict[type, EngineHandler] = {
            OutputBatch: self._output.on_outputs,
            RequestRejected: self._flow.on_rejected,
            EngineReady: self._flow.on_engine_ready,
            EngineNotReady: self._flow.on_engine_not_ready,
            EngineShutdown: self._flow.on_shutdown,
            # a decode engine holds a hand-over's KV (or gave up): its lease is released
            HandoverDone: lambda _link, msg: self._handovers.done(msg.rid, msg.ok),
            StatsReply: self._reports.on_stats_reply,
            PrefixCacheReset: self._reports.on_prefix_cache_reset,
        }
        self._poller = zmq.Poller()
        self._opened = False
        self._stopped = False

    # ---- life cycle --------------------------------------------------------------------------

    def open(self) -> None:
        """Bind the client socket, connect to every scheduler; the loop may turn from here."""
        self._clients.bind()
        self._engines.connect(time.monotonic())
        self._poller.register(self._clients.socket, zmq.POLLIN)
        for link in self._engines.links:
            self._poller.register(link.socket, zmq.POLLIN)
            self._poller.register(link.watch.monitor, zmq.POLLIN)
        self._opened = True
        self.log.info(
            "frontend_listening",
            address=self.config.frontend_address,
            schedulers=list(self.config.scheduler_addresses),
            router_policy=self.config.router.policy,
            frontend_id=self.config.frontend_id,
            identity=self.identity,
        )

    def request_drain(self) -> None:
        """SIGTERM: new requests get `shutting_down`; the loop stops once the open ones ended
        or the grace period is over. Only sets a flag (safe from a signal handler)."""
        self._drain.request()

    @property
    def stopped(self) -> bool:
        """True once drained: the engines were told FrontendBye; `close()` is left to do."""
        return self._stopped

    def run(self) -> int:
        """Serve until drained; returns the process exit code."""
        if not self._opened:
            self.open()
        tick_ms = int(self.config.heartbeat_s * 500)  # housekeeping at twice the heartbeat rate
        while not self._stopped:
            self.turn(tick_ms)
        self.close()
        return 0

    def turn(self, timeout_ms: int) -> None:
        """One turn of the loop: wait up to `timeout_ms` for a socket, serve what is there,
        then housekeeping. Call after `open()`."""
        events = dict(self._poller.poll(timeout_ms))
        for link in self._engines.links:
            if link.socket in events:
                self._on_engine(link)
        if self._clients.socket in events:
            self._clients.serve_turn(self._on_command)
        for link in self._engines.links:
            if link.watch.monitor in events:
                link.on_monitor(self.log)
        self._housekeeping(time.monotonic())

    def close(self) -> None:
        """Called once the loop stopped (by `run()`, or by whoever turns it)."""
        self._clients.close()
        self._engines.close()
        self.log.info("frontend_stopped")

    def check_invariants(self) -> None:
        """Read-only, between turns: every part's invariants (raises AssertionError)."""
        self._flow.check_invariants()  # the table, the engines and their counts
        self._clients.check_invariants()
        self._output.check_invariants()
        self._reports.check_invariants()

    # ---- dispatch ----------------------------------------------------------------------------

    def _on_command(self, ident: bytes, cmd: cc.ClientCommand) -> None:
        """One valid client command (client_link.py checked it) to its handler."""
        self._client_handlers[type(cmd)](ident, cmd)

    def _on_engine(self, link: EngineLink) -> None:
        for parts in one_turn(link.socket):
            guarded(self.log, "scheduler_message_failed",
                    lambda frame: self._on_engine_frame(link, frame), parts[-1])  # fmt: skip

    def _on_engine_frame(self, link: EngineLink, frame: bytes) -> None:
        """One scheduler message (it sends one frame each); a bad one is a logged drop."""
        link.heard(time.monotonic())
        try:
            msg = decode(frame)
        except DecodeError as exc:
            self.log.warning("bad_scheduler_frame", engine=link.name, code=exc.code,
                             message=exc.message)  # fmt: skip
            return
        handler = self._engine_handlers.get(type(msg))
        if handler is None:
            self.log.warning("unexpected_scheduler_message", engine=link.name,
                             type=type(msg).__name__)  # fmt: skip
            return
        handler(link, msg)

    # ---- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        cfg = self.config
        for link in self._engines.links:
            link.hello(now, cfg.heartbeat_s)
            if link.silent_for(now) > cfg.scheduler_timeout_s:
                msg = f"no word from the scheduler for {cfg.scheduler_timeout_s:g} s"
                self._flow.engine_lost(link.index, LOST, msg)
        self._handovers.renew(now)
        self._clients.heartbeat(self._table.connections(), now)
        self._reports.expire(now)
        self._resumption.expire(now)
        if self._drain.due(now, len(self._table)):
            self._flow.shut_down()
            self._engines.say_bye()
            self._stopped = True
