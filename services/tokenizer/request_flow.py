"""Where requests open and close: admission of a `generate`, and every way a request ends
other than its final output (a client's abort, a client gone, the engine's refusal, the
engine's loss, shutdown).

Each request runs on one engine, chosen when it arrives. An engine that is lost (its scheduler
closed the connection, said EngineShutdown, or was silent for `scheduler_timeout_s`) leaves the
rotation at once; its requests that have not streamed a token yet are resubmitted to another
ready engine, the others end with `engine_unreachable` (docs/protocol.md). The output path
(output_path.py) closes the requests that finish through `close`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional, Union

from services.tokenizer.admission import Rejection, over_connection_cap, prompt_ids
from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.constraint_check import ConstraintCheck
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.engines import Engines
from services.tokenizer.request_state import ClientRequest
from services.tokenizer.request_table import RequestTable
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.text_codec import TextCodec
from services.tokenizer.tracing import request_trace
from shared.protocol import client_channel as cc
from shared.protocol.engine_channel import (
    AbortRequest,
    EngineShutdown,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.tracing import Tracing
from shared.transport import Drain

LOST = "scheduler_unreachable"  # the not-ready reason of a lost engine


class RequestFlow:
    """Opens requests into the table and closes them out of it, keeping the engines' counts
    in step. Owns the rid counter and the request totals for `stats`.

    Invariant (`check_invariants`): every open request is known to exactly one engine, the one
    it was last sent to, and each engine carries exactly the open requests sent to it."""

    def __init__(
        self,
        config: FrontendConfig,
        codec: TextCodec,
        table: RequestTable,
        engines: Engines,
        clients: ClientLink,
        drain: Drain,
        log: Any,
        tracing: Optional[Tracing] = None,
    ) -> None:
        """`tracing`: spans of each request (services/tokenizer/tracing.py); None: off."""
        self._config = config
        self._tracing = tracing
        self._codec = codec
        self._table = table
        self._engines = engines
        self._clients = clients
        self._drain = drain  # read only: has SIGTERM asked to stop?
        self._log = log
        self._constraints = ConstraintCheck(codec)  # structured outputs, compiled at admission
        self._next_seq = 0  # the next rid's number
        self._num_requests_total = 0
        self._num_resubmitted_total = 0

    @property
    def num_requests_total(self) -> int:
        """Requests admitted since start (`stats`)."""
        return self._num_requests_total

    @property
    def num_resubmitted_total(self) -> int:
        """Requests moved to another engine after theirs was lost (`stats`)."""
        return self._num_resubmitted_total

    def ready(self) -> bool:
        """Whether a `generate` may be admitted now (health's `ready`)."""
        return self._engines.reference() is not None and not self._drain.requested

    def not_ready_reason(self) -> Optional[str]:
        """Why `ready()` is False (health's `reason`, the not_ready error); None when ready."""
        if self._drain.requested:
            return "shutting_down"
        if self._engines.reference() is not None:
            return None
        return self._engines.not_ready_reason()

    # ---- opening ---------------------------------------------------------------------------

    def on_generate(self, ident: bytes, cmd: cc.GenerateCommand) -> None:
        """A client's `generate`: admitted and sent to an engine, or refused with an error."""
        now = time.monotonic()
        checked = self._admit(ident, cmd)
        if isinstance(checked, Rejection):
            self._clients.reply_error(ident, checked.code, checked.message, cmd.id)
            return
        rid = f"{self._config.frontend_id}-{self._next_seq}"
        self._next_seq += 1
        trace = request_trace(self._tracing, cmd.traceparent, now, cmd.id)
        traceparent = None
        if trace is not None:
            trace.submitted(rid)
            traceparent = trace.traceparent
        submit = SubmitRequest(rid, checked, cmd.sampling, cmd.priority, time.time(), traceparent)
        engine = self._engines.submit(submit, exclude=None)
        if engine is None:
            msg = "no scheduler is connected"
            self._clients.reply_error(ident, ErrorCode.ENGINE_UNREACHABLE, msg, cmd.id)
            if trace is not None:
                trace.end(None, None)
            return
        state = self._new_request(ident, cmd, submit, engine, now)
        state.trace = trace
        self._table.add(state)
        self._num_requests_total += 1
        self._log.info(
            "request_received", rid=rid, client_id=cmd.id, num_prompt_tokens=len(checked),
            max_tokens=cmd.sampling.max_tokens, stream=cmd.stream, num_stop=len(cmd.stop),
            engine=self._engines.name_of(engine),
        )  # fmt: skip

    def _admit(self, ident: bytes, cmd: cc.GenerateCommand) -> Union[list[int], Rejection]:
        """Prompt ids, or the first reason (in the documented order) to refuse the request."""
        if self._table.rid_of(ident, cmd.id) is not None:
            return Rejection(ErrorCode.DUPLICATE_ID, f"id {cmd.id!r} is already in flight")
        if self._drain.requested:
            return Rejection(ErrorCode.SHUTTING_DOWN, "the frontend is shutting down")
        engine = self._engines.reference()
        if engine is None:
            reason = self.not_ready_reason()
            return Rejection(ErrorCode.NOT_READY, f"the engine is not ready ({reason})")
        if not ident.startswith(self._config.cap_exempt_prefix.encode()):
            cap = self._config.max_requests_per_connection
            if (over := over_connection_cap(self._table.num_on(ident), cap)) is not None:
                return over
        ids = prompt_ids(cmd, self._codec, engine)
        if isinstance(ids, Rejection):
            return ids
        return self._constraints.problem(cmd.sampling, engine) or ids

    def _new_request(
        self,
        ident: bytes,
        cmd: cc.GenerateCommand,
        submit: SubmitRequest,
        engine: int,
        now: float,
    ) -> ClientRequest:
        """The state of a request that `engine` took."""
        ids = submit.prompt_token_ids
        return ClientRequest(
            rid=submit.rid,
            client_id=cmd.id,
            identity=ident,
            stream=cmd.stream,
            sampling=cmd.sampling,
            num_prompt_tokens=len(ids),
            detokenizer=IncrementalDetokenizer(self._codec.decode, ids),
            stops=StopStrings(cmd.stop),
            received_at=now,
            engine=engine,
            submit=submit,
        )

    # ---- closing ---------------------------------------------------------------------------

    def close(self, rid: str) -> ClientRequest:
        """Called once a request ended, whichever way: out of the table, off its engine."""
        state = self._table.pop(rid)
        self._engines.release(state.engine)
        if state.trace is not None:
            state.trace.end(state.first_token_at, state.last_token_at)
        return state

    def on_abort(self, ident: bytes, cmd: cc.AbortCommand) -> None:
        """A client's `abort`: the request's `done` (reason abort), then `aborted`."""
        rid = self._table.rid_of(ident, cmd.id)
        if rid is None:
            self._clients.send(ident, cc.aborted_reply(cmd.id, False))
            return
        state = self.close(rid)
        self._engines.send(state.engine, AbortRequest(rid, "abort"))
        self._log.info("request_aborted", rid=rid, client_id=cmd.id, reason="client")
        for frame in [*state.abort(time.monotonic()), cc.aborted_reply(cmd.id, True)]:
            if not self._clients.send(ident, frame):
                return

    def client_gone(self, ident: bytes, reason: str) -> None:
        """Called by the client link when a send to `ident` failed: its requests end."""
        for rid in self._table.rids_of(ident):
            state = self.close(rid)
            self._engines.send(state.engine, AbortRequest(rid, "client_gone"))
            self._log.info("request_aborted", rid=rid, reason="client_gone", detail=reason)

    def on_rejected(self, link: EngineLink, msg: RequestRejected) -> None:
        """The engine refused a request (ignored when it runs elsewhere by now)."""
        state = self._table.get(msg.rid)
        if state is not None and state.engine == link.index:
            self.close(msg.rid)
            self._log.info("request_rejected", rid=msg.rid, code=msg.code, engine=link.name)
            self._clients.send_error(state.identity, state.error(msg.code, msg.message))

    def on_shutdown(self, link: EngineLink, msg: EngineShutdown) -> None:
        """The scheduler said it stops: the engine is lost."""
        self.engine_lost(link.index, LOST, f"the scheduler stopped: {msg.reason}")

    def scheduler_gone(self, engine: int) -> None:
        """Called by the engine link's watch when the scheduler's connection dropped."""
        self.engine_lost(engine, LOST, "the connection to the scheduler was lost")

    def engine_lost(self, engine: int, reason: str, message: str) -> None:
        """Out of rotation; its requests that streamed nothing yet run on another ready engine,
        the others end with `engine_unreachable`."""
        mine = self._table.rids_on(engine)
        if not self._engines.mark_lost(engine, reason, message, len(mine)):
            return
        for rid in mine:
            state = self._table.get(rid)
            if state is None:
                continue  # a failed send already dropped it with its connection
            self._engines.send(engine, AbortRequest(rid, "engine_lost"))  # a hung one may wake
            if not self._resubmitted(state, engine):
                self._fail(state, engine, message)

    def _resubmitted(self, state: ClientRequest, lost: int) -> bool:
        """Run a request that streamed nothing on another ready engine; False when it cannot."""
        if not state.streamed_nothing() or state.submit is None:
            return False
        engine = self._engines.submit(state.submit, exclude=lost)
        if engine is None:
            return False
        self._engines.release(lost)
        state.route_to(engine)
        self._num_resubmitted_total += 1
        name_of = self._engines.name_of
        self._log.info("request_resubmitted", rid=state.rid, from_engine=name_of(lost),
                       engine=name_of(engine))  # fmt: skip
        return True

    def _fail(self, state: ClientRequest, lost: int, message: str) -> None:
        self.close(state.rid)
        self._log.info("request_failed", rid=state.rid, code=ErrorCode.ENGINE_UNREACHABLE,
                       engine=self._engines.name_of(lost))  # fmt: skip
        error = state.error(ErrorCode.ENGINE_UNREACHABLE, message)
        self._clients.send_error(state.identity, error)

    def shut_down(self) -> None:
        """Called when the drain's grace period is over: every open request fails with
        `shutting_down` (and is aborted in its engine)."""
        msg = "the frontend stopped before the request finished"
        for rid in self._table.rids():
            if rid not in self._table:
                continue  # a failed send already dropped it with its connection
            state = self.close(rid)
            self._log.info("request_failed", rid=rid, code=ErrorCode.SHUTTING_DOWN)
            self._engines.send(state.engine, AbortRequest(rid, "shutdown"))
            self._clients.send(state.identity, state.error(ErrorCode.SHUTTING_DOWN, msg))

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when an open request is unknown to its engine's
        count, or the table, the engines or a request break their own invariants."""
        self._table.check_invariants()
        self._engines.check_invariants()
        num_engines = len(self._engines.links)
        on = Counter(state.engine for state in self._table)
        assert all(0 <= e < num_engines for e in on), on
        carried = {e: self._engines.num_carried(e) for e in range(num_engines)}
        assert carried == {e: on[e] for e in range(num_engines)}, (carried, on)
        prefix = f"{self._config.frontend_id}-"
        for state in self._table:
            assert state.rid.startswith(prefix), state.rid
            assert int(state.rid[len(prefix) :]) < self._next_seq, state.rid
            assert state.submit is not None and state.submit.rid == state.rid, state.rid
        assert len(self._table) <= self._num_requests_total
