"""The scheduler's link to its frontends: the frontend socket, which frontend is alive, which
frontend owns each live request, and where each output goes.

Socket: ROUTER, bound. Each frontend's DEALER identity keys its replies; `owners` maps every
live rid to the identity that submitted it, so tokens never go to another frontend. A frontend
is alive while it talks (FrontendHello every second); silent for `frontend_timeout_s`, gone from
the socket (ROUTER_MANDATORY) or saying FrontendBye, its requests are aborted. With `curve_keys`
the socket is a CURVE server admitting only `authorized_frontends/` (ZAP domain "frontends").

The link admits nothing on its own: whether the engine takes a request, and the core itself,
come from the loop (`FrontendHost`, services/scheduler/server.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import zmq

from services.scheduler.output_routing import split_by_frontend
from services.scheduler.server_config import SchedulerCore, ServerConfig
from shared.curve import FRONTENDS_DOMAIN
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import (
    AbortRequest,
    DrainEngine,
    EngineNotReady,
    EngineReady,
    FrontendBye,
    FrontendHello,
    OutputBatch,
    PrefixCacheReset,
    ReleaseLease,
    RenewLeases,
    RequestOutput,
    RequestRejected,
    ResetPrefixCache,
    StatsQuery,
    StatsReply,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.transport import PeerClock, guarded, one_turn, router_socket


class FrontendHost(Protocol):
    """What the link asks of the loop."""

    @property
    def sched(self) -> Optional[SchedulerCore]: ...  # None until a worker said WorkerReady
    @property
    def last_step_id(self) -> int: ...  # the step outputs outside a step are dated with
    def ready_message(self) -> EngineReady | EngineNotReady: ...
    def submit_refusal(self) -> Optional[tuple[str, str]]: ...  # (code, message): drain, ...
    def stats(self) -> dict[str, float]: ...
    def drain_for_maintenance(self, drain: bool) -> None: ...  # DrainEngine


class FrontendLink:
    """Owns the frontend socket, frontend liveness and request ownership."""

    def __init__(
        self, ctx: zmq.Context, config: ServerConfig, host: FrontendHost, log: Any
    ) -> None:
        self._config = config
        self._host = host
        self.log = log
        self.owners: dict[str, bytes] = {}  # live rid -> frontend identity
        self.frontends = PeerClock(config.frontend_timeout_s)
        self.sock = router_socket(
            ctx, log, max_msg_bytes=config.hard_max_frame_bytes,
            send_hwm=0,  # local frontends: never drop an output batch
            curve_keys=config.curve_keys, zap_domain=FRONTENDS_DOMAIN,
        )  # fmt: skip
        self.sock.bind(config.frontend_address)
        self._idents: dict[str, bytes] = {}  # frontend id -> its process's socket identity
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            SubmitRequest: self._on_submit,
            AbortRequest: self._on_abort,
            FrontendHello: self._on_hello,
            StatsQuery: lambda ident, msg: self.send(ident, StatsReply(msg.query_id, host.stats())),
            FrontendBye: lambda ident, _msg: self.frontend_gone(ident, "frontend said bye"),
            ResetPrefixCache: self._on_reset_prefix_cache,
            DrainEngine: lambda _ident, msg: host.drain_for_maintenance(msg.drain),
            ReleaseLease: self._on_release_lease,
            RenewLeases: self._on_renew_leases,
        }

    def close(self) -> None:
        self.sock.close()

    # ---- receiving ---------------------------------------------------------------------------

    def on_readable(self) -> None:
        """Called when the socket is readable. Bounded, so a flood of submits cannot starve
        the worker socket."""
        for parts in one_turn(self.sock, max_messages=1024, max_turn_s=1.0):
            guarded(self.log, "frontend_message_failed", self._on_parts, parts)

    def _on_parts(self, parts: list[bytes]) -> None:
        """One frontend message: [identity, frame]; called inside the boundary."""
        ident, frame = parts[0], parts[-1]
        try:
            msg = decode(frame, max_size=self._config.max_frame_bytes)
        except DecodeError as exc:
            self.log.warning("bad_frontend_frame", code=exc.code, message=exc.message)
            return
        # Any message proves a frontend alive; a one-off StatsQuery (a healthcheck) does
        # not make its sender a frontend to watch.
        if ident in self.frontends or isinstance(msg, (FrontendHello, SubmitRequest)):
            self.frontends.heard(ident, time.monotonic())
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.log.warning("unexpected_frontend_message", code="unexpected_type",
                             type=type(msg).__name__)  # fmt: skip
            return
        handler(ident, msg)

    def _on_hello(self, ident: bytes, msg: FrontendHello) -> None:
        """A frontend's heartbeat, answered with the engine's state. The first hello of a
        restarted frontend (its id, a new socket identity) ends what the old process left."""
        old = self._idents.get(msg.frontend_id)
        if old is not None and old != ident:
            self.frontend_gone(old, "the frontend restarted")
        self._idents[msg.frontend_id] = ident
        self.send(ident, self._host.ready_message())

    def _on_abort(self, ident: bytes, msg: AbortRequest) -> None:
        """Only the frontend that submitted a request may abort it (others: a logged drop)."""
        owner = self.owners.get(msg.rid)
        if owner is not None and owner != ident:
            self.log.warning("abort_from_another_frontend", rid=msg.rid, code="not_owner")
            return
        self.abort(msg.rid, msg.reason)

    def _on_submit(self, ident: bytes, req: SubmitRequest) -> None:
        rejection = self._host.submit_refusal()  # drain, no worker: None implies a core
        sched = self._host.sched
        if rejection is None and req.rid in self.owners:
            rejection = (ErrorCode.DUPLICATE_ID, f"request {req.rid!r} is already live")
        if rejection is not None or sched is None:
            code, message = rejection or (ErrorCode.NOT_READY, "the worker is not ready")
            self._reject(ident, RequestRejected(req.rid, code, message))
            return
        refused = sched.add_request(req)
        if refused is not None:
            self._reject(ident, refused)
            return
        self.owners[req.rid] = ident
        self.log.info("request_admitted", rid=req.rid, num_prompt_tokens=len(req.prompt_token_ids),
                      num_output_tokens=len(req.output_token_ids), attempt=req.attempt)  # fmt: skip

    def _on_release_lease(self, _ident: bytes, msg: ReleaseLease) -> None:
        """A prefill engine's hand-over is over (docs/design/disaggregation.md): its blocks
        are freed; the loop sends the EndLease to the worker before its next plan."""
        sched = self._host.sched
        if sched is not None and sched.leases.release(msg.lease_id, msg.generation):
            self.log.info("lease_released", lease_id=msg.lease_id)

    def _on_renew_leases(self, _ident: bytes, msg: RenewLeases) -> None:
        """The frontend's heartbeat names the hand-overs it still waits on: they last on."""
        sched = self._host.sched
        if sched is not None:
            sched.leases.renew(msg.lease_ids)

    def _on_reset_prefix_cache(self, ident: bytes, msg: ResetPrefixCache) -> None:
        sched = self._host.sched
        dropped = sched.reset_prefix_cache() if sched is not None else 0
        self.log.info("prefix_cache_reset", num_blocks_dropped=dropped)
        self.send(ident, PrefixCacheReset(msg.query_id, dropped))

    def _reject(self, ident: bytes, rejected: RequestRejected) -> None:
        self.log.info("request_rejected", rid=rejected.rid, code=rejected.code)
        self.send(ident, rejected)

    # ---- requests and frontends --------------------------------------------------------------

    def abort(self, rid: str, reason: str) -> None:
        """Idempotent: unknown or finished rids are ignored."""
        sched = self._host.sched
        if sched is None or rid not in self.owners:
            return
        final = sched.abort_request(rid, reason)
        self.log.info("request_aborted", rid=rid, reason=reason)
        if final is not None:
            self.emit_finals([final])
        self.owners.pop(rid, None)

    def frontend_gone(self, ident: bytes, reason: str) -> None:
        """Its requests are aborted; it is watched again when it next says hello."""
        self.frontends.forget(ident)
        self._idents = {fid: i for fid, i in self._idents.items() if i != ident}
        rids = [rid for rid, owner in self.owners.items() if owner == ident]
        self.log.warning("frontend_gone", frontend=ident, reason=reason, num_aborted=len(rids))
        sched = self._host.sched
        for rid in rids:
            self.owners.pop(rid, None)  # first, so the final output is not sent back
            if sched is not None:
                sched.abort_request(rid, "frontend_gone")

    def fail_all(self, code: str, message: str) -> None:
        """Every live request ends with the error `code` (a maintenance drain's time-out)."""
        sched = self._host.sched
        for rid in list(self.owners):
            final = sched.abort_request(rid, code) if sched is not None else None
            if final is not None:
                error = dataclasses.replace(final, finish_reason="error", error_code=code,
                                            error_message=message)  # fmt: skip
                self.emit_finals([error])
            self.owners.pop(rid, None)

    def drop_all(self, reason: str) -> None:
        """Every live request is aborted here without a final output (the frontends resume
        them elsewhere: the engine stops)."""
        sched, rids = self._host.sched, list(self.owners)
        for rid in rids:
            self.owners.pop(rid)
            if sched is not None:
                sched.abort_request(rid, reason)
        if rids:
            self.log.info("requests_dropped", reason=reason, num_dropped=len(rids))

    def check_silence(self, now: float) -> None:
        """Housekeeping: frontends silent for `frontend_timeout_s` are gone."""
        for ident in self.frontends.silent(now):
            self.frontend_gone(ident, f"silent for {self.frontends.timeout_s:.0f} s")

    # ---- sending -----------------------------------------------------------------------------

    def broadcast(self, msg: Any) -> None:
        """Every watched frontend hears `msg` (engine ready / not ready / shut down)."""
        for ident in self.frontends.peers():
            self.send(ident, msg)

    def emit(self, batch: OutputBatch) -> None:
        """Send each frontend its own part of one step's outputs (services/scheduler/
        output_routing.py). Called after the next plan has left."""
        for ident, part in split_by_frontend(batch, self.owners, self._log_finished).items():
            self.send(ident, part)

    def emit_finals(self, finals: list[RequestOutput]) -> None:
        """Outputs outside a step (abort, worker lost): each frontend gets its final ones."""
        if finals:
            self.emit(OutputBatch(self._host.last_step_id, finished=finals))

    def _log_finished(self, out: RequestOutput) -> None:
        self.log.info(
            "request_finished",
            rid=out.rid,
            finish_reason=out.finish_reason,
            num_output_tokens=out.num_output_tokens,
            error_code=out.error_code,
        )

    def send(self, ident: bytes, msg: Any) -> None:
        try:
            self.sock.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that frontend disconnected
            self.frontend_gone(ident, f"send failed: {exc.strerror}")
