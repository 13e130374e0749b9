"""Resumption: the one way an open request moves from one engine to another (or back to the
same engine once it is restarted). docs/design/resumption.md is the design; this is its seam.

The frontend holds every token a request received. When the request's current attempt is over
on its engine (the engine was lost, is draining, or refused it), `resume` starts the next
attempt: the same prompt and sampling (seed pinned at admission), every token so far apart
from the prompt, under a rid of its own (`<rid>.<attempt>`), so the engine continues exactly
where the last one stopped: the draw for output n stays u(seed, n), and penalties, max_tokens,
stop strings, usage and timings count every token once. The old attempt is aborted on its
engine, and its late outputs find no request (they are keyed by the old rid): fencing.

The new attempt goes to a ready engine other than the one it left; when there is none it waits
here ("parked") until an engine says ready (`on_engine_ready`), at most `resume_timeout_s`.
A request whose attempts ended by a fault more than `max_resumes` times, or that waited too
long, ends with `engine_unreachable`. Moves that are no fault (a drain) are not counted.

Callers: the request flow (an engine lost, draining or refusing), the loop's housekeeping
(`expire`); any later hand-over (e.g. prefill on one engine, decode on another) that fails
calls `resume` the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from services.tokenizer.client_link import ClientLink
from services.tokenizer.config import FrontendConfig
from services.tokenizer.engines import Engines
from services.tokenizer.handovers import Handovers
from services.tokenizer.request_state import ClientRequest
from services.tokenizer.request_table import RequestTable
from shared.protocol.engine_channel import AbortRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.kv_channel import KvHandover


class Resumption:
    """Owns the requests waiting for an engine (by their current rid, with their deadline)
    and the count of resumptions. Invariant (`check_invariants`): a request is parked exactly
    when it is open with no engine."""

    def __init__(
        self,
        config: FrontendConfig,
        table: RequestTable,
        engines: Engines,
        clients: ClientLink,
        log: Any,
        handovers: Handovers,
    ) -> None:
        self._config = config
        self._handovers = handovers
        self._table = table
        self._engines = engines
        self._clients = clients
        self._log = log
        self._parked: dict[str, float] = {}  # engine rid -> monotonic deadline, oldest first
        self._num_resumed_total = 0

    @property
    def num_resumed_total(self) -> int:
        """Attempts started after an earlier one ended (`stats`)."""
        return self._num_resumed_total

    @property
    def num_parked(self) -> int:
        """Requests waiting for an engine now."""
        return len(self._parked)

    def resume(
        self,
        state: ClientRequest,
        reason: str,
        fault: bool,
        now: float,
        kv_source: Optional[KvHandover] = None,
    ) -> None:
        """The current attempt of `state` is over on its engine (`reason`, logged and sent with
        the abort): fence and abort it, then run the next attempt on another ready engine, or
        park it. `fault`: counted against `max_resumes` (a drain is not). `kv_source`: a
        prefill engine's hand-over (docs/design/disaggregation.md): the next attempt goes to a
        decode engine with it (any ready engine may take it, the prefill one included)."""
        left = state.engine
        if left is not None:
            self._engines.send(left, AbortRequest(state.engine_rid, reason))
            self._engines.release(left)
        old_rid = state.engine_rid
        self._handovers.release(old_rid)  # a lease the ended attempt carried
        submit = state.next_attempt(fault)
        if kv_source is not None:
            submit = dataclasses.replace(submit, kv_source=kv_source)
        self._table.rekey(state, old_rid)
        self._parked.pop(old_rid, None)
        if state.num_faults > self._config.max_resumes:
            message = f"the request was resumed {self._config.max_resumes} times ({reason})"
            self._fail(state, message)
            return
        self._num_resumed_total += 1
        engine = self._engines.submit(submit, exclude=left if kv_source is None else None)
        if kv_source is not None and left is not None:
            if engine is not None and self._engines.role_of(engine) == "decode":
                self._handovers.opened(state.engine_rid, left, kv_source)
            else:  # no decode engine took it: it recomputes (or waits), the lease is of no use
                self._handovers.release_now(left, kv_source)
        name = None if left is None else self._engines.name_of(left)
        self._log.info(
            "request_resumed", rid=state.rid, attempt=state.attempt, reason=reason,
            from_engine=name, engine=None if engine is None else self._engines.name_of(engine),
            num_output_tokens=len(submit.output_token_ids),
        )  # fmt: skip
        state.route_to(engine)
        if engine is None:
            self._parked[state.engine_rid] = now + self._config.resume_timeout_s

    def on_engine_ready(self) -> None:
        """An engine (re)joined: every parked request is sent to a ready engine, oldest first."""
        for rid in list(self._parked):
            state = self._table.get(rid)
            if state is None:
                self._parked.pop(rid)  # closed meanwhile (its client left)
                continue
            engine = self._engines.submit(state.attempt_submit(), exclude=None)
            if engine is None:
                return  # none takes requests after all: they keep waiting
            del self._parked[rid]
            state.route_to(engine)
            self._log.info("request_unparked", rid=state.rid, attempt=state.attempt,
                           engine=self._engines.name_of(engine))  # fmt: skip

    def forget(self, rid: str) -> None:
        """A parked request was closed by someone else (an abort, its client gone)."""
        self._parked.pop(rid, None)

    def expire(self, now: float) -> None:
        """Housekeeping: requests parked past `resume_timeout_s` end `engine_unreachable`."""
        late = [rid for rid, deadline in self._parked.items() if now > deadline]
        for rid in late:
            del self._parked[rid]
            state = self._table.get(rid)
            if state is not None:
                timeout = self._config.resume_timeout_s
                self._fail(state, f"no engine took the request within {timeout:g} s")

    def _fail(self, state: ClientRequest, message: str) -> None:
        """The request ends `engine_unreachable` (it holds no engine any more)."""
        self._parked.pop(state.engine_rid, None)
        self._table.pop(state.engine_rid)
        self._log.info("request_failed", rid=state.rid, code=ErrorCode.ENGINE_UNREACHABLE,
                       attempt=state.attempt, detail=message)  # fmt: skip
        self._clients.send_error(state.identity, state.error(ErrorCode.ENGINE_UNREACHABLE, message))

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when a parked request is not open without an
        engine, or an open request without an engine is not parked."""
        waiting = set(self._table.rids_on(None))
        assert waiting == set(self._parked), (waiting, set(self._parked))
