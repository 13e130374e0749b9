"""Where requests open and close: admission of a `generate`, every way a request ends other
than its final output (a client's abort, a client gone, the engine's refusal, shutdown), and
when it must move to another engine (lost, draining, or refusing it for its own reason): the
resumption (resumption.py).

Each request runs on one engine at a time, chosen when it arrives. An engine that is lost (its
scheduler closed the connection, said EngineShutdown, or was silent for `scheduler_timeout_s`)
leaves the rotation at once; each of its requests resumes on another ready engine, or waits for
one (docs/design/resumption.md). The output path (output_path.py) closes the requests that
finish through `close`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any, Optional, Union

from services.tokenizer.admission import Rejection, over_connection_cap, prompt_ids
from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.constraint_check import ConstraintCheck
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.engine_link import DRAINING, EngineLink
from services.tokenizer.engines import Engines
from services.tokenizer.handovers import Handovers
from services.tokenizer.request_state import ClientRequest, Progress
from services.tokenizer.request_table import RequestTable
from services.tokenizer.resumption import Resumption
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.text_codec import TextCodec
from services.tokenizer.tracing import request_trace
from shared.protocol import client_channel as cc
from shared.protocol.engine_channel import (
    AbortRequest,
    DrainEngine,
    EngineNotReady,
    EngineReady,
    EngineShutdown,
    RequestOutput,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import default_seed
from shared.tracing import Tracing
from shared.transport import Drain

LOST = "scheduler_unreachable"  # the not-ready reason of a lost engine
# Refusals that say the engine takes nothing now (not that the request is wrong): it moves.
ENGINE_REFUSALS = frozenset({ErrorCode.NOT_READY, ErrorCode.SHUTTING_DOWN})


class RequestFlow:
    """Opens requests into the table and closes them out of it, keeping the engines' counts
    in step. Owns the rid counter and the request totals for `stats`.

    Invariant (`check_invariants`): every open request is known to exactly one engine, the one
    its current attempt was sent to, or waits for one in the resumption; each engine carries
    exactly the open requests sent to it."""

    def __init__(
        self,
        config: FrontendConfig,
        codec: TextCodec,
        table: RequestTable,
        engines: Engines,
        clients: ClientLink,
        resumption: Resumption,
        drain: Drain,
        log: Any,
        rid_prefix: str,
        handovers: Handovers,
        tracing: Optional[Tracing] = None,
    ) -> None:
        """`rid_prefix`: what every rid of this process starts with (its socket identity and
        a dash: rids of a restarted frontend never meet an earlier process's). `tracing`:
        spans of each request (services/tokenizer/tracing.py); None: off."""
        self._config = config
        self._tracing = tracing
        self._codec = codec
        self._table = table
        self._engines = engines
        self._clients = clients
        self._resumption = resumption
        self._handovers = handovers
        self._drain = drain  # read only: has SIGTERM asked to stop?
        self._log = log
        self._constraints = ConstraintCheck(codec)  # structured outputs, compiled at admission
        self._rid_prefix = rid_prefix
        self._next_seq = 0  # the next rid's number
        self._num_requests_total = 0

    @property
    def num_requests_total(self) -> int:
        """Requests admitted since start (`stats`)."""
        return self._num_requests_total

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
        """A client's `generate`: admitted and sent to an engine, or refused with an error. A
        `generate` that resumes a stream (its `resume` field) goes on from what the client
        has; one complete already ends at once."""
        now = time.monotonic()
        checked = self._admit(ident, cmd)
        if isinstance(checked, Rejection):
            self._clients.reply_error(ident, checked.code, checked.message, cmd.id)
            return
        rid = f"{self._rid_prefix}{self._next_seq}"
        self._next_seq += 1
        trace = request_trace(self._tracing, cmd.traceparent, now, cmd.id)
        traceparent = None
        if trace is not None:
            trace.submitted(rid)
            traceparent = trace.traceparent
        sampling = cmd.sampling  # a sampled request's seed is pinned: resumption draws alike
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=default_seed(rid))
        resumed = cmd.resume_token_ids or []
        t = cmd.targets
        submit = SubmitRequest(rid, checked, sampling, cmd.priority, time.time(), list(resumed),
                               traceparent=traceparent, slo_class=t.slo_class, ttft_ms=t.ttft_ms,
                               tpot_ms=t.tpot_ms, on_slo_miss=t.on_slo_miss)  # fmt: skip
        state = self._new_request(ident, cmd, submit, now)
        state.trace = trace
        if cmd.resume_token_ids is not None and not self._resumed(state, cmd, now):
            if trace is not None:
                trace.end(None, None)
            return
        engine = self._engines.submit(submit, exclude=None)
        if engine is None:
            msg = "no scheduler is connected"
            self._clients.reply_error(ident, ErrorCode.ENGINE_UNREACHABLE, msg, cmd.id)
            if trace is not None:
                trace.end(None, None)
            return
        state.route_to(engine)
        self._table.add(state)
        self._num_requests_total += 1
        self._log.info(
            "request_received", rid=rid, client_id=cmd.id, num_prompt_tokens=len(checked),
            max_tokens=cmd.sampling.max_tokens, stream=cmd.stream, num_stop=len(cmd.stop),
            num_resumed_tokens=len(resumed), engine=self._engines.name_of(engine),
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
        if cmd.resume_token_ids is not None:
            if (problem := resume_problem(cmd, engine)) is not None:
                return problem
        return self._constraints.problem(cmd.sampling, engine) or ids

    def _resumed(self, state: ClientRequest, cmd: cc.GenerateCommand, now: float) -> bool:
        """Take what a resuming client has; False when the request ended here already (a text
        that does not match, or a request that is complete)."""
        if not state.take_resumed(cmd.resume_token_ids or [], cmd.resume_text, now):
            msg = "`resume.text` is not the text of `resume.token_ids`"
            self._clients.reply_error(state.identity, ErrorCode.INVALID_FIELD, msg, cmd.id)
            return False
        reference = self._engines.reference()
        eos = frozenset(reference.eos_token_ids if reference is not None else ())
        stop_ids = frozenset(cmd.sampling.stop_token_ids) | (
            frozenset() if cmd.sampling.ignore_eos else eos
        )
        ended = state.ended_already(stop_ids, now)
        if ended is None:
            return True
        self._log.info("request_finished", rid=state.rid, finish_reason=ended.finish_reason,
                       num_output_tokens=len(state.token_ids), resumed=True)  # fmt: skip
        for frame in ended.frames:
            if not self._clients.send(state.identity, frame):
                break
        return False

    def _new_request(
        self, ident: bytes, cmd: cc.GenerateCommand, submit: SubmitRequest, now: float
    ) -> ClientRequest:
        """The state of a new request (not yet on an engine)."""
        ids = submit.prompt_token_ids
        return ClientRequest(
            rid=submit.rid,
            client_id=cmd.id,
            identity=ident,
            stream=cmd.stream,
            sampling=submit.sampling,
            num_prompt_tokens=len(ids),
            detokenizer=IncrementalDetokenizer(self._codec.decode, ids),
            stops=StopStrings(cmd.stop),
            received_at=now,
            engine=None,
            submit=submit,
        )

    # ---- closing ---------------------------------------------------------------------------

    def close(self, rid: str) -> ClientRequest:
        """Called once a request ended, whichever way (`rid`: its current attempt's): out of
        the table, off its engine (or out of the resumption's wait)."""
        state = self._table.pop(rid)
        self._engines.release(state.engine)
        self._handovers.release(rid)
        if state.trace is not None:
            state.trace.end(state.first_token_at, state.last_token_at)
        self._resumption.forget(rid)
        return state

    def _abort_in_engine(self, state: ClientRequest, reason: str) -> None:
        if state.engine is not None:
            self._engines.send(state.engine, AbortRequest(state.engine_rid, reason))

    def on_abort(self, ident: bytes, cmd: cc.AbortCommand) -> None:
        """A client's `abort`: the request's `done` (reason abort), then `aborted`."""
        rid = self._table.rid_of(ident, cmd.id)
        if rid is None:
            self._clients.send(ident, cc.aborted_reply(cmd.id, False))
            return
        state = self.close(rid)
        self._abort_in_engine(state, "abort")
        self._log.info("request_aborted", rid=state.rid, client_id=cmd.id, reason="client")
        for frame in [*state.abort(time.monotonic()), cc.aborted_reply(cmd.id, True)]:
            if not self._clients.send(ident, frame):
                return

    def client_gone(self, ident: bytes, reason: str) -> None:
        """Called by the client link when a send to `ident` failed: its requests end."""
        for rid in self._table.rids_of(ident):
            state = self.close(rid)
            self._abort_in_engine(state, "client_gone")
            self._log.info("request_aborted", rid=state.rid, reason="client_gone", detail=reason)

    def on_rejected(self, link: EngineLink, msg: RequestRejected) -> None:
        """The engine refused a request (ignored when it runs elsewhere by now): one the engine
        takes nothing now moves (resumption), any other ends with the engine's code."""
        state = self._table.get(msg.rid)
        if state is None or state.engine != link.index:
            return
        if msg.code in ENGINE_REFUSALS:  # a drain's refusal (a race) is no fault
            reason = f"refused: {msg.code}"
            self._resumption.resume(state, reason, not link.draining, time.monotonic())
            return
        self.close(msg.rid)
        self._log.info("request_rejected", rid=state.rid, code=msg.code, engine=link.name)
        self._clients.send_error(state.identity, state.error(msg.code, msg.message))

    # ---- KV hand-over (docs/design/disaggregation.md) -------------------------------------

    def on_handover(self, link: EngineLink, out: RequestOutput, progress: Progress) -> None:
        """A prefill engine's request ended "handover" (its first token applied: `progress`):
        unless that token ended it here (a stop string), it resumes on a decode engine with
        the lease's reference; a hand-over nobody takes is released at once."""
        assert out.handover is not None
        ref = dataclasses.replace(
            out.handover, kv_endpoint=self._engines.kv_endpoint_of(link.index)
        )
        state = self._table.get(out.rid)
        if state is None or state.engine != link.index or progress.finished:
            self._handovers.release_now(link.index, ref)
            return
        self._resumption.resume(state, "handover", False, time.monotonic(), kv_source=ref)

    # ---- engines coming and going ----------------------------------------------------------

    def on_engine_ready(self, link: EngineLink, msg: EngineReady) -> None:
        """EngineReady: the engine takes requests (again); those waiting for one go now."""
        self._engines.on_ready(link, msg)
        self._resumption.on_engine_ready()

    def on_engine_not_ready(self, link: EngineLink, msg: EngineNotReady) -> None:
        """EngineNotReady: no new requests there. Those in flight stay (the engine recomputes
        them when its worker is back), unless it is draining: then they move to the other
        ready engines, if there are any (else they finish where they are)."""
        self._engines.on_not_ready(link, msg)
        if link.draining:
            self._move_off(link.index, "drained")

    def on_drain(self, ident: bytes, cmd: cc.DrainCommand) -> None:
        """A client's `drain`: the engine is told to stop (or start again) admitting; this
        frontend moves its own requests off it at once (the others do when the engine tells
        them). Answered with the engine's name and what this frontend moved."""
        engine = self._engines.index_of(cmd.engine)
        if engine is None:
            msg = f"no engine {cmd.engine!r} (engines: {', '.join(self._engines.names)})"
            self._clients.reply_error(ident, ErrorCode.INVALID_FIELD, msg, cmd.id)
            return
        if not self._engines.send(engine, DrainEngine(cmd.drain)):
            msg = f"engine {cmd.engine} is not connected"
            self._clients.reply_error(ident, ErrorCode.ENGINE_UNREACHABLE, msg, cmd.id)
            return
        moved = 0
        link = self._engines.links[engine]
        if cmd.drain:
            self._engines.on_not_ready(link, EngineNotReady(DRAINING))
            moved = self._move_off(engine, "drained")
        self._log.info("engine_drain", engine=cmd.engine, drain=cmd.drain, num_moved=moved)
        self._clients.send(ident, cc.drain_reply(cmd.id, cmd.engine, cmd.drain, moved))

    def _move_off(self, engine: int, reason: str) -> int:
        """Every request on `engine` resumes on another ready engine (no fault); none moves
        when no other engine is ready. How many moved."""
        if not any(link.ready for link in self._engines.links if link.index != engine):
            return 0
        rids = self._table.rids_on(engine)
        now = time.monotonic()
        for rid in rids:
            state = self._table.get(rid)
            if state is not None:
                self._resumption.resume(state, reason, False, now)
        return len(rids)

    def on_shutdown(self, link: EngineLink, msg: EngineShutdown) -> None:
        """The scheduler said it stops: the engine is lost."""
        self.engine_lost(link.index, LOST, f"the scheduler stopped: {msg.reason}")

    def scheduler_gone(self, engine: int) -> None:
        """Called by the engine link's watch when the scheduler's connection dropped."""
        self.engine_lost(engine, LOST, "the connection to the scheduler was lost")

    def engine_lost(self, engine: int, reason: str, message: str) -> None:
        """Out of rotation; each of its requests resumes on another ready engine or waits for
        one (resumption.py)."""
        mine = self._table.rids_on(engine)
        if not self._engines.mark_lost(engine, reason, message, len(mine)):
            return
        now = time.monotonic()
        for rid in mine:
            state = self._table.get(rid)
            if state is not None:  # else a failed send already dropped it with its connection
                self._resumption.resume(state, "engine_lost", True, now)

    def shut_down(self) -> None:
        """Called when the drain's grace period is over: every open request fails with
        `shutting_down` (and is aborted in its engine)."""
        msg = "the frontend stopped before the request finished"
        for rid in self._table.rids():
            if rid not in self._table:
                continue  # a failed send already dropped it with its connection
            state = self.close(rid)
            self._log.info("request_failed", rid=state.rid, code=ErrorCode.SHUTTING_DOWN)
            self._abort_in_engine(state, "shutdown")
            self._clients.send(state.identity, state.error(ErrorCode.SHUTTING_DOWN, msg))

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when an open request is unknown to its engine's
        count, or the table, the engines, the resumption or a request break their own."""
        self._table.check_invariants()
        self._engines.check_invariants()
        self._resumption.check_invariants()
        num_engines = len(self._engines.links)
        on = Counter(state.engine for state in self._table if state.engine is not None)
        assert all(0 <= e < num_engines for e in on), on
        carried = {e: self._engines.num_carried(e) for e in range(num_engines)}
        assert carried == {e: on[e] for e in range(num_engines)}, (carried, on)
        for state in self._table:
            assert state.rid.startswith(self._rid_prefix), state.rid
            assert int(state.rid[len(self._rid_prefix) :]) < self._next_seq, state.rid
            assert state.submit is not None and state.submit.rid == state.rid, state.rid
        assert len(self._table) <= self._num_requests_total


def resume_problem(cmd: cc.GenerateCommand, engine: EngineReady) -> Optional[Rejection]:
    """Why a `generate`'s `resume` cannot go on (a token outside the vocabulary, more tokens
    than max_tokens), or None."""
    ids = cmd.resume_token_ids or []
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    if bad:
        message = f"resume token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})"
        return Rejection(ErrorCode.INVALID_TOKEN_ID, message)
    if len(ids) > cmd.sampling.max_tokens:
        message = f"resume holds {len(ids)} tokens, more than max_tokens"
        return Rejection(ErrorCode.INVALID_PARAMS, message)
    return None
