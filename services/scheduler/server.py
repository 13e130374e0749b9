"""The scheduler process loop: frontends <-> Scheduler core <-> worker rank(s), one thread.

Sockets (both bound here):
* frontends: ROUTER. Each frontend's DEALER identity keys its replies; `owners` maps every live
  rid to the identity that submitted it, so tokens never go to another frontend. A frontend is
  alive while it talks (FrontendHello every second); silent for `frontend_timeout_s`, gone from
  the socket (ROUTER_MANDATORY) or saying FrontendBye, its requests are aborted.
* workers: ROUTER, every rank's DEALER has identity "worker-<rank>". Each rank gets every plan;
  rank 0 answers. ZMTP heartbeats plus the socket's monitor events detect a lost worker
  (see shared/worker_server.py): then frontends hear EngineNotReady, and every request the
  worker held restarts by recompute once a worker says WorkerReady again (up to `max_retries`
  times each; requeued requests wait at most `requeue_timeout_s`, then fail `worker_failed`).
  A failed step fails only the requests in that step.

Loop: schedule -> send plan -> poll (frontends keep flowing while the plan runs) -> result ->
update -> send the next plan -> emit this step's outputs (so the worker is already busy while
outputs are encoded). One plan is in flight at a time. SIGTERM drains (see `request_drain`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.scheduler.output_routing import split_by_frontend
from services.scheduler.server_config import SchedulerCore, SchedulerFactory, ServerConfig
from services.scheduler.stats import StepRecord
from services.scheduler.summary import EngineSummary
from shared.curve import make_curve_server
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
    RequestOutput,
    RequestRejected,
    ResetPrefixCache,
    StatsQuery,
    StatsReply,
    SubmitRequest,
)
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import (
    StepPlan,
    StepResult,
    WorkerFailure,
    WorkerReady,
    WorkerShutdown,
)
from shared.transport import guarded, one_turn
from shared.worker_server import WORKER_LINK_EVENTS, LinkEvents, set_heartbeat, worker_identity

HOUSEKEEPING_S = 0.5  # longest poll: frontend liveness and drain checks run at least this often
MIN_POLL_S = 0.002  # floor for the core's timers, so a zero timeout never spins


def _shape(ready: WorkerReady) -> tuple[Any, ...]:
    """What a core is built for: a returning worker with the same shape continues its work."""
    return (ready.model_name, ready.num_blocks, ready.block_size, ready.max_model_len,
            ready.vocab_size, tuple(ready.eos_token_ids))  # fmt: skip


@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    record: Optional[StepRecord]  # what the core decided for this plan (the step log line)
    sent_at: float  # time.time() when the plan left
    gap_s: Optional[float]  # previous result -> this plan, when sent back to back


class SchedulerServer:
    """Owns the sockets and the core; `run()` is the process's whole life."""

    def __init__(
        self,
        config: ServerConfig,
        make_scheduler: SchedulerFactory,
        log: Any,
        context: Optional[zmq.Context] = None,
    ) -> None:
        self.config = config
        self._make_scheduler = make_scheduler
        self.log = log
        self._ctx = context or zmq.Context.instance()
        self.sched: Optional[SchedulerCore] = None
        self._ranks: dict[int, WorkerReady] = {}
        self._owners: dict[str, bytes] = {}  # live rid -> frontend identity
        self._engine_shape: Optional[tuple[Any, ...]] = None  # what the core was built for
        self._frontends: dict[bytes, float] = {}  # identity -> last heard (monotonic)
        self._in_flight: Optional[_InFlight] = None
        self._worker_lost_at: Optional[float] = None  # monotonic; None while workers are up
        self._link = LinkEvents()  # a refused peer's disconnect is no worker lost
        self._last_result_at: Optional[float] = None
        self._last_step_id = 0
        self._num_steps = 0
        self._drain_requested = False
        self._draining_since: Optional[float] = None
        self._stopped = False
        self._summary = EngineSummary(config.summary_interval_s, log)
        self._open_sockets()

    # ---- lifecycle ---------------------------------------------------------------------------

    def _open_sockets(self) -> None:
        cfg = self.config
        self.fe = self._ctx.socket(zmq.ROUTER)
        self.fe.setsockopt(zmq.ROUTER_MANDATORY, 1)  # undeliverable -> error, not silent drop
        self.fe.setsockopt(zmq.SNDHWM, 0)  # local frontends: never drop an output batch
        self.fe.setsockopt(zmq.MAXMSGSIZE, cfg.hard_max_frame_bytes)
        self.fe.setsockopt(zmq.LINGER, 500)
        self.fe.bind(cfg.frontend_address)
        self.wk = self._ctx.socket(zmq.ROUTER)
        self.wk.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.wk.setsockopt(zmq.LINGER, 500)
        set_heartbeat(self.wk)
        make_curve_server(self.wk, cfg.curve_keys, self.log)  # ZAP: see __main__
        self.wk_monitor = self.wk.get_monitor_socket(WORKER_LINK_EVENTS)
        self.wk.bind(cfg.worker_address)
        self.poller = zmq.Poller()
        for sock in (self.wk, self.wk_monitor, self.fe):
            self.poller.register(sock, zmq.POLLIN)
        self.log.info(
            "scheduler_listening", frontend=cfg.frontend_address, worker=cfg.worker_address
        )

    def request_drain(self) -> None:
        """Called from the SIGTERM handler: only sets a flag, the loop does the rest."""
        self._drain_requested = True

    def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        try:
            while not self._stopped:
                self._maybe_send_plan(back_to_back=False)
                events = dict(self.poller.poll(self._poll_timeout_ms()))
                if self.wk_monitor in events:
                    self._on_monitor()
                if self.wk in events:
                    self._on_worker()
                if self.fe in events:
                    self._on_frontends()
                self._housekeeping()
        finally:
            self.wk.disable_monitor()
            for sock in (self.wk_monitor, self.wk, self.fe):
                sock.close()
        self.log.info("scheduler_stopped", num_steps=self._num_steps)
        return 0

    def _poll_timeout_ms(self) -> int:
        timeout = HOUSEKEEPING_S
        if self.sched is not None and self._in_flight is None:
            core_timeout = self.sched.next_timeout()
            if core_timeout is not None:
                timeout = min(timeout, max(core_timeout, MIN_POLL_S))
        return int(timeout * 1000) or 1

    # ---- worker side -------------------------------------------------------------------------

    def _workers_up(self) -> bool:
        return self.sched is not None and len(self._ranks) >= self.config.num_workers

    def _maybe_send_plan(self, back_to_back: bool) -> None:
        if not self._workers_up() or self._in_flight is not None or self._stopped:
            return
        plan = self.sched.schedule()
        if plan is None:
            return
        frame = encode(plan)
        sent_at = time.time()
        if not self._send_workers(frame):
            return
        gap = sent_at - self._last_result_at if back_to_back and self._last_result_at else None
        record = self.sched.last_step_record
        self._in_flight = _InFlight(plan=plan, record=record, sent_at=sent_at, gap_s=gap)

    def _send_workers(self, frame: bytes) -> bool:
        """Send one frame to every rank; a rank that is gone counts as a lost worker."""
        try:
            for rank in list(self._ranks):
                self.wk.send_multipart([worker_identity(rank), frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._on_worker_lost(f"cannot reach the worker: {exc.strerror}")
            return False
        return True

    def _on_worker(self) -> None:
        for parts in one_turn(self.wk, max_messages=1024, max_turn_s=1.0):
            guarded(self.log, "worker_message_failed", self._on_worker_parts, parts)

    def _on_worker_parts(self, parts: list[bytes]) -> None:
        """One worker message: [identity, frame]. Called inside the boundary: a frame that
        raises is a logged drop, the loop goes on."""
        ident, frame = parts[0], parts[-1]
        received_at = time.time()  # the result -> next plan gap starts here, before decode
        try:
            msg = decode(frame)
        except DecodeError as exc:  # logged drop: a garbled frame is no verdict on a step
            self.log.error("bad_worker_frame", code=exc.code, message=exc.message, ident=ident)
            return
        if isinstance(msg, StepResult) and ident != worker_identity(0):
            self.log.warning("result_from_unknown_identity", ident=ident)
            return
        if isinstance(msg, WorkerReady):
            self._on_worker_ready(msg)
        elif isinstance(msg, StepResult):
            self._on_result(msg, received_at)
        elif isinstance(msg, WorkerFailure):
            self._on_step_failed(msg)
        else:
            self.log.warning("unexpected_worker_message", type=type(msg).__name__, ident=ident)

    def _on_worker_ready(self, ready: WorkerReady) -> None:
        if ready.rank in self._ranks:  # it came back without us seeing it go
            self._on_worker_lost(f"rank {ready.rank} said ready again")
        self._ranks[ready.rank] = ready
        self.log.info("worker_ready", **dataclasses.asdict(ready))
        if len(self._ranks) < self.config.num_workers:
            return
        first = self._ranks[min(self._ranks)]
        small = min(self._ranks.values(), key=lambda r: r.num_blocks)
        merged = dataclasses.replace(first, num_blocks=small.num_blocks)
        if self.sched is not None and self._engine_shape != _shape(merged):
            # a different worker (model, pool): requests planned for the old one cannot go on
            message = "the worker came back with a different model or KV pool"
            self._emit_finals(self.sched.fail_all(ErrorCode.WORKER_FAILED, message))
            self.sched = None
        if self.sched is None:
            self.sched = self._make_scheduler(merged)
            self._engine_shape = _shape(merged)
        self._worker_lost_at = None
        for ident in list(self._frontends):
            self._send_frontend(ident, self._ready_message())
        self.log.info("engine_ready", num_blocks=small.num_blocks, model=first.model_name)

    def _ready_message(self) -> EngineReady | EngineNotReady:
        if not self._workers_up():
            return EngineNotReady(reason="waiting for the worker")
        first = self._ranks[min(self._ranks)]
        return EngineReady(
            model_name=first.model_name,
            max_model_len=first.max_model_len,
            vocab_size=first.vocab_size,
            eos_token_ids=list(first.eos_token_ids),
            num_blocks=min(r.num_blocks for r in self._ranks.values()),
            block_size=first.block_size,
        )

    def _on_result(self, result: StepResult, now: float) -> None:
        flight = self._in_flight
        if self.sched is None or flight is None or flight.plan.step_id != result.step_id:
            self.log.warning("stale_result", step_id=result.step_id)
            return
        self._in_flight = None
        self._last_result_at = now
        self._last_step_id = result.step_id
        self._num_steps += 1
        outputs = self.sched.update(result)
        # The worker waits for the next plan: send it before logging and emitting outputs.
        self._maybe_send_plan(back_to_back=True)
        self._log_step(flight, result, now, len(outputs))
        self._emit(outputs)
        if self.sched is not None:
            self.sched.after_plan()  # deferred core work, while the worker computes

    def _log_step(self, flight: _InFlight, result: StepResult, now: float, n_out: int) -> None:
        # converted once, after the next plan has left: the record is not copied on send
        fields = flight.record.to_dict() if flight.record is not None else {}
        fields.update(
            step_id=result.step_id,
            num_seqs=flight.plan.num_seqs,
            total_tokens=flight.plan.total_tokens,
            num_outputs=n_out,
            t_plan=flight.sent_at,
            t_result=now,
            step_s=now - flight.sent_at,
            forward_s=result.forward_s,
            gap_s=flight.gap_s,
        )
        self.log.info("step", **fields)
        self._summary.on_step(now - flight.sent_at)

    def _on_step_failed(self, failure: WorkerFailure) -> None:
        """Only the requests of the step in flight fail (the failure is pinned on them); a
        failure naming another step is stale. A failure without a step id (the worker could
        not read the plan) is pinned on the plan in flight, else only logged."""
        self.log.error(
            "step_failed", step_id=failure.step_id, code=failure.code, message=failure.message
        )
        flight = self._in_flight
        if flight is None or failure.step_id not in (None, flight.plan.step_id):
            return
        self._in_flight = None
        if self.sched is not None:
            rids = [*flight.plan.rids, *(seq.rid for seq in flight.plan.new_seqs)]
            message = f"the worker failed the step: {failure.message}"
            self._emit_finals(self.sched.fail_step(rids, ErrorCode.WORKER_FAILED, message))

    def _on_monitor(self) -> None:
        while self.wk_monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(self.wk_monitor)
            if self._link.counts_as_lost(event["event"]) and self._ranks:
                self._on_worker_lost("worker connection lost")
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self.log.info("worker_connected")

    def _on_worker_lost(self, reason: str) -> None:
        """Every request the worker held restarts by recompute when a worker is back (or fails
        past `max_retries`); frontends hear EngineNotReady and keep their requests."""
        self.log.error("worker_lost", reason=reason, num_live=len(self._owners))
        if self.sched is not None:
            message = f"the worker was lost {self.config.max_retries + 1} times: {reason}"
            finals = self.sched.requeue_all(
                self.config.max_retries, ErrorCode.WORKER_FAILED, message
            )
            self._emit_finals(finals)
        self._ranks.clear()
        self._in_flight = None
        if self._worker_lost_at is None:
            self._worker_lost_at = time.monotonic()
        for ident in list(self._frontends):
            self._send_frontend(ident, EngineNotReady(reason=reason))

    def _check_requeue_timeout(self, now: float) -> None:
        """Requeued requests wait at most `requeue_timeout_s` for a worker."""
        lost_at = self._worker_lost_at
        if lost_at is None or self.sched is None or now - lost_at <= self.config.requeue_timeout_s:
            return
        message = f"no worker came back within {self.config.requeue_timeout_s:g} s"
        self._emit_finals(self.sched.fail_all(ErrorCode.WORKER_FAILED, message))
        self._worker_lost_at = now  # requests submitted later wait their own full time

    # ---- frontend side -----------------------------------------------------------------------

    def _on_frontends(self) -> None:
        # Bounded so a flood of submits cannot starve the worker socket.
        for parts in one_turn(self.fe, max_messages=1024, max_turn_s=1.0):
            guarded(self.log, "frontend_message_failed", self._on_frontend_parts, parts)

    def _on_frontend_parts(self, parts: list[bytes]) -> None:
        """One frontend message: [identity, frame]; called inside the boundary."""
        ident, frame = parts[0], parts[-1]
        try:
            msg = decode(frame, max_size=self.config.max_frame_bytes)
        except DecodeError as exc:
            self.log.warning("bad_frontend_frame", code=exc.code, message=exc.message)
            return
        # Any message proves a frontend alive; a one-off StatsQuery (a healthcheck) does
        # not make its sender a frontend to watch.
        if ident in self._frontends or isinstance(msg, (FrontendHello, SubmitRequest)):
            self._frontends[ident] = time.monotonic()
        self._on_frontend_message(ident, msg)

    def _on_frontend_message(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, SubmitRequest):
            self._on_submit(ident, msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.rid, msg.reason)
        elif isinstance(msg, FrontendHello):
            self._send_frontend(ident, self._ready_message())
        elif isinstance(msg, StatsQuery):
            self._send_frontend(ident, StatsReply(query_id=msg.query_id, stats=self._stats()))
        elif isinstance(msg, FrontendBye):
            self._frontend_gone(ident, "frontend said bye")
        elif isinstance(msg, ResetPrefixCache):
            dropped = self.sched.reset_prefix_cache() if self.sched is not None else 0
            self.log.info("prefix_cache_reset", num_blocks_dropped=dropped)
            self._send_frontend(ident, PrefixCacheReset(msg.query_id, dropped))
        else:
            self.log.warning("unexpected_frontend_message", type=type(msg).__name__)

    def _on_submit(self, ident: bytes, req: SubmitRequest) -> None:
        rejection = None
        if self._drain_requested:
            rejection = (ErrorCode.SHUTTING_DOWN, "the engine is shutting down")
        elif self.sched is None or not self._workers_up():
            rejection = (ErrorCode.NOT_READY, "the worker is not ready")
        elif req.rid in self._owners:
            rejection = (ErrorCode.DUPLICATE_ID, f"request {req.rid!r} is already live")
        if rejection is not None:
            self._reject(ident, RequestRejected(req.rid, *rejection))
            return
        refused = self.sched.add_request(req)
        if refused is not None:
            self._reject(ident, refused)
            return
        self._owners[req.rid] = ident
        self.log.info("request_admitted", rid=req.rid, num_prompt_tokens=len(req.prompt_token_ids))

    def _reject(self, ident: bytes, rejected: RequestRejected) -> None:
        self.log.info("request_rejected", rid=rejected.rid, code=rejected.code)
        self._send_frontend(ident, rejected)

    def _abort(self, rid: str, reason: str) -> None:
        """Idempotent: unknown or finished rids are ignored."""
        if self.sched is None or rid not in self._owners:
            return
        final = self.sched.abort_request(rid, reason)
        self.log.info("request_aborted", rid=rid, reason=reason)
        if final is not None:
            self._emit_finals([final])
        self._owners.pop(rid, None)

    def _frontend_gone(self, ident: bytes, reason: str) -> None:
        self._frontends.pop(ident, None)
        rids = [rid for rid, owner in self._owners.items() if owner == ident]
        self.log.warning("frontend_gone", frontend=ident, reason=reason, num_aborted=len(rids))
        for rid in rids:
            self._owners.pop(rid, None)  # first, so the final output is not sent back
            if self.sched is not None:
                self.sched.abort_request(rid, "frontend_gone")

    def _emit(self, batch: OutputBatch) -> None:
        """Send each frontend its own part of one step's outputs (services/scheduler/
        output_routing.py). Called after the next plan has left."""
        for ident, part in split_by_frontend(batch, self._owners, self._log_finished).items():
            self._send_frontend(ident, part)

    def _log_finished(self, out: RequestOutput) -> None:
        self.log.info(
            "request_finished",
            rid=out.rid,
            finish_reason=out.finish_reason,
            num_output_tokens=out.num_output_tokens,
            error_code=out.error_code,
        )

    def _emit_finals(self, finals: list[RequestOutput]) -> None:
        """Outputs outside a step (abort, worker lost): each frontend gets its final ones."""
        if finals:
            self._emit(OutputBatch(self._last_step_id, finished=finals))

    def _send_frontend(self, ident: bytes, msg: Any) -> None:
        try:
            self.fe.send_multipart([ident, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that frontend disconnected
            self._frontend_gone(ident, f"send failed: {exc.strerror}")

    def _stats(self) -> dict[str, float]:
        stats = dict(self.sched.stats()) if self.sched is not None else {}
        stats.update(
            ready=float(self._workers_up()),
            draining=float(self._draining_since is not None),
            num_frontends=float(len(self._frontends)),
            num_workers_ready=float(len(self._ranks)),
            num_live_requests=float(len(self._owners)),
            num_results=float(self._num_steps),
        )
        return stats

    # ---- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self._summary.maybe_emit(now, lambda: None if self.sched is None else self.sched.stats())
        self._check_requeue_timeout(now)
        limit = self.config.frontend_timeout_s
        for ident, seen in list(self._frontends.items()):
            if now - seen > limit:
                self._frontend_gone(ident, f"silent for {limit:.0f} s")
        if self._drain_requested and self._draining_since is None:
            self._draining_since = now
            self.log.info(
                "draining", num_live=len(self._owners), grace_s=self.config.drain_timeout_s
            )
        if self._draining_since is not None:
            expired = now - self._draining_since > self.config.drain_timeout_s
            if not self._owners or expired:
                self._finish_drain()

    def _finish_drain(self) -> None:
        for rid in list(self._owners):
            self._abort(rid, "shutdown")
        self._send_workers(encode(WorkerShutdown("drained")))
        self.sched = None
        for ident in list(self._frontends):
            self._send_frontend(ident, EngineShutdown(reason="scheduler stopped"))
        self._stopped = True
