"""What the frontend tells a client about itself and its engines: `health` (answered at once),
`stats` and `reset_prefix_cache` (asked of every engine, answered when all did or at the
deadline; engine_queries.py).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.engine_queries import (
    RESET_PREFIX_CACHE,
    STATS,
    PendingQueries,
    PendingQuery,
    reset_reply,
    stats_reply,
)
from services.tokenizer.engines import Engines
from services.tokenizer.output_path import OutputPath
from services.tokenizer.request_flow import RequestFlow
from services.tokenizer.request_table import RequestTable
from services.tokenizer.resumption import Resumption
from shared.protocol import client_channel as cc
from shared.protocol.engine_channel import PrefixCacheReset, StatsReply


class Reports:
    """Client handlers for `health`, `stats` and `reset_prefix_cache`, engine handlers for
    their answers, and `expire` from the loop's housekeeping. Owns the open queries; reads
    everything else."""

    def __init__(
        self,
        config: FrontendConfig,
        table: RequestTable,
        engines: Engines,
        clients: ClientLink,
        flow: RequestFlow,
        resumption: Resumption,
        output: OutputPath,
    ) -> None:
        self._config = config
        self._table = table
        self._engines = engines
        self._clients = clients
        self._flow = flow
        self._resumption = resumption
        self._output = output
        self._queries = PendingQueries(config.frontend_id, config.stats_timeout_s)

    # ---- client commands -------------------------------------------------------------------

    def on_health(self, ident: bytes, cmd: cc.HealthCommand) -> None:
        """Answered at once from what the frontend knows (each engine's last report)."""
        engine = self._engines.reference()
        self._clients.send(ident, cc.health_reply(
            cmd.id, self._flow.ready(), self._flow.not_ready_reason(),
            engine.model_name if engine else None, engine.max_model_len if engine else None,
            engine.vocab_size if engine else None, self._config.frontend_id,
            self._engines.health(),
        ))  # fmt: skip

    def on_stats(self, ident: bytes, cmd: cc.StatsCommand) -> None:
        """A client's `stats`: asked of every engine, answered with the frontend's own."""
        self._ask(ident, cmd.id, STATS)

    def on_reset_prefix_cache(self, ident: bytes, cmd: cc.ResetPrefixCacheCommand) -> None:
        """A client's `reset_prefix_cache`: asked of every engine, answered with their sum."""
        self._ask(ident, cmd.id, RESET_PREFIX_CACHE)

    def _ask(self, ident: bytes, client_id: Optional[str], kind: str) -> None:
        """A query every engine answers: sent to each connected one; unanswered, the time-out
        replies with what came."""
        msg = self._queries.message(kind)
        asked = self._engines.send_all(msg)
        query = self._queries.open(msg.query_id, ident, client_id, kind, time.monotonic(), asked)
        if not asked:
            self._reply(query)

    # ---- engine answers and deadlines ------------------------------------------------------

    def on_stats_reply(self, link: EngineLink, msg: StatsReply) -> None:
        """An engine's answer to a `stats` query (a late or unknown one is dropped)."""
        self._answer(msg.query_id, link.index, msg.stats)

    def on_prefix_cache_reset(self, link: EngineLink, msg: PrefixCacheReset) -> None:
        """An engine's answer to `reset_prefix_cache` (a late or unknown one is dropped)."""
        self._answer(msg.query_id, link.index, msg.num_blocks_dropped)

    def expire(self, now: float) -> None:
        """Called every housekeeping tick: queries past their deadline are answered now."""
        for query in self._queries.expired(now):
            self._reply(query)

    def _answer(self, qid: str, engine: int, value: Any) -> None:
        query = self._queries.answer(qid, engine, value)
        if query is not None:
            self._reply(query)

    def _reply(self, query: PendingQuery) -> None:
        names = self._engines.names
        if query.kind == RESET_PREFIX_CACHE:
            reply = reset_reply(query, names)
        else:
            reply = stats_reply(query, names, self._flow.ready(), self._frontend_stats())
        self._clients.send(query.identity, reply)

    def _frontend_stats(self) -> dict[str, float]:
        return {
            "requests_in_flight": float(len(self._table)),
            "connections": float(len(self._table.connections())),
            "requests_total": float(self._flow.num_requests_total),
            "errors_total": float(self._clients.num_errors_total),
            "requests_resumed_total": float(self._resumption.num_resumed_total),
            "requests_waiting_for_engine": float(self._resumption.num_parked),
            "num_engines": float(len(self._engines.links)),
            "num_engines_ready": float(self._engines.num_ready),
            **self._output.latency_percentiles(time.monotonic()),
        }

    def check_invariants(self) -> None:
        """Read-only; the open queries' own invariants (engine_queries.PendingQueries)."""
        self._queries.check_invariants()
