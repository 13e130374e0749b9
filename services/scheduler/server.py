"""The scheduler process loop: frontends <-> Scheduler core <-> worker rank(s), one thread.

Sockets (both bound here, each behind its link; shared set-up in shared/transport.py):
* frontends: services/scheduler/frontend_link.py (who is alive, who owns each request, where
  outputs go).
* workers: services/scheduler/worker_link.py (ranks, handshakes, lost workers). Each rank gets
  every plan; rank 0 answers. When a worker is lost, frontends hear EngineNotReady, and every
  request the worker held restarts by recompute once a worker says WorkerReady again (up to
  `max_retries` times each; requeued requests wait at most `requeue_timeout_s`, then fail
  `worker_failed`). A failed step fails only the requests it can be pinned on (bisection).

Loop: schedule -> send plan -> poll (frontends keep flowing while the plan runs) -> result ->
update -> send the next plan -> emit this step's outputs (so the worker is already busy while
outputs are encoded). One plan is in flight at a time; with `--async-scheduling` two: plan N+1
is built while the worker runs step N, so the worker finds its next plan waiting
(services/scheduler/inflight.py). It leaves right after plan N when steps are short, or, when
they are long next to the scheduler's own path, is held until shortly before step N is
expected to end, so that requests arriving meanwhile join it (services/scheduler/dispatch.py:
the rule decides itself from the measured step times). The plans in flight are the core's one
record (`SchedulerCore.in_flight`, services/scheduler/inflight.py): the loop stamps each when it
leaves and reads it to hold, log and time steps. SIGTERM drains (see `request_drain`)."""

from __future__ import annotations

import time
from typing import Any, Optional

import zmq

from services.scheduler.dispatch import DispatchPolicy
from services.scheduler.frontend_link import FrontendLink
from services.scheduler.inflight import InFlightStep
from services.scheduler.maintenance import MaintenanceDrain
from services.scheduler.server_config import SchedulerCore, SchedulerFactory, ServerConfig
from services.scheduler.slo_classes import reported_classes
from services.scheduler.step_log import StepLogColumns
from services.scheduler.summary import EngineSummary
from services.scheduler.worker_link import WorkerLink
from shared.protocol.codec import encode
from shared.protocol.engine_channel import EngineNotReady, EngineReady, EngineShutdown
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import (
    KvPulled,
    StepPlan,
    StepResult,
    WorkerFailure,
    WorkerReady,
    WorkerShutdown,
)
from shared.transport import Drain

DRAINING = "draining"  # the not-ready reason while drained for maintenance
HOUSEKEEPING_S = 0.5  # longest poll: frontend liveness and drain checks run at least this often
MIN_POLL_S = 0.002  # floor for the core's timers, so a zero timeout never spins
HOLD_RESOLUTION_S = 0.001  # the poll's unit: a plan due within it leaves now


def _shape(ready: WorkerReady) -> tuple[Any, ...]:
    """What a core is built for: a returning worker with the same shape continues its work."""
    return (ready.model_name, ready.num_blocks, ready.block_size, ready.max_model_len,
            ready.vocab_size, tuple(ready.eos_token_ids))  # fmt: skip


def _decode_only(plan: StepPlan) -> bool:
    """Every sequence decodes one token (no new sequence, no other count)."""
    return not plan.new_seqs and not plan.counts


class SchedulerServer:
    """Owns the links and the core; `run()` is the process's whole life. Is the links' host
    (FrontendHost, WorkerHost): they report to it, it decides."""

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
        ctx = context or zmq.Context.instance()
        self.sched: Optional[SchedulerCore] = None
        self._engine_shape: Optional[tuple[Any, ...]] = None  # what the core was built for
        self._worker_lost_at: Optional[float] = None  # monotonic; None while workers are up
        self._last_result_at: Optional[float] = None
        self._dispatch = DispatchPolicy(enabled=False)  # replaced with each new core
        # time.time() plan N+1 is held until (infinity: until the result in flight arrives)
        self._hold_until: Optional[float] = None
        self._update_s = 0.0  # the last result's update() (part of the scheduler's path)
        self.last_step_id = 0
        self._num_steps = 0
        self._drain = Drain(config.drain_timeout_s, log)
        self._maintenance = MaintenanceDrain(config.drain_timeout_s, log)
        self._stopped = False
        self._summary = EngineSummary(config.summary_interval_s, log)
        self._step_columns = StepLogColumns()  # the step log's compact columns (_log_step)
        self.frontends = FrontendLink(ctx, config, self, log)
        self.workers = WorkerLink(ctx, config, self, log)  # CURVE/ZAP: see __main__
        self.poller = zmq.Poller()
        for sock in (self.workers.sock, self.workers.monitor, self.frontends.sock):
            self.poller.register(sock, zmq.POLLIN)
        self.log.info(
            "scheduler_listening", frontend=config.frontend_address, worker=config.worker_address
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def request_drain(self) -> None:
        """Called from the SIGTERM handler: only sets a flag, the loop does the rest."""
        self._drain.request()

    def run(self) -> int:
        """Serve until drained. Returns the process exit code."""
        wk, monitor, fe = self.workers.sock, self.workers.monitor, self.frontends.sock
        try:
            while not self._stopped:
                self._maybe_send_plan(back_to_back=False)
                events = dict(self.poller.poll(self._poll_timeout_ms()))
                if monitor in events:
                    self.workers.on_monitor()
                if wk in events:
                    self.workers.on_readable()
                if fe in events:
                    self.frontends.on_readable()
                self._housekeeping()
                self._send_handover_messages()
        finally:
            self.workers.close()
            self.frontends.close()
        self.log.info("scheduler_stopped", num_steps=self._num_steps)
        return 0

    def _poll_timeout_ms(self) -> int:
        timeout = HOUSEKEEPING_S
        if self.sched is not None and len(self.sched.in_flight) == 0:
            core_timeout = self.sched.next_timeout()
            if core_timeout is not None:
                timeout = min(timeout, max(core_timeout, MIN_POLL_S))
        if self._hold_until is not None:  # wake to send the held plan (_hold_next: >= 1 ms on)
            timeout = min(timeout, max(self._hold_until - time.time(), HOLD_RESOLUTION_S))
        return int(timeout * 1000) or 1

    # ---- what the frontend link asks (FrontendHost) ------------------------------------------

    def _workers_up(self) -> bool:
        return self.sched is not None and self.workers.num_ready() >= self.config.num_workers

    def submit_refusal(self) -> Optional[tuple[str, str]]:
        if self._drain.requested:
            return (ErrorCode.SHUTTING_DOWN, "the engine is shutting down")
        if self._maintenance.active:
            return (ErrorCode.NOT_READY, "the engine is draining")
        if self.sched is None or not self._workers_up():
            return (ErrorCode.NOT_READY, "the worker is not ready")
        return None

    def drain_for_maintenance(self, drain: bool) -> None:
        """DrainEngine: stop (or resume) admitting; every frontend hears the new state."""
        if self._maintenance.set(drain, time.monotonic(), len(self.frontends.owners)):
            self.frontends.broadcast(self.ready_message())

    def ready_message(self) -> EngineReady | EngineNotReady:
        if self._maintenance.active:
            return EngineNotReady(reason=DRAINING)
        if not self._workers_up():
            return EngineNotReady(reason="waiting for the worker")
        first = self.workers.first()
        assert self.sched is not None  # the workers are up
        load = self.sched.stats()  # the frontends route by it
        return EngineReady(
            model_name=first.model_name,
            max_model_len=first.max_model_len,
            vocab_size=first.vocab_size,
            eos_token_ids=list(first.eos_token_ids),
            num_blocks=min(r.num_blocks for r in self.workers.ranks.values()),
            block_size=first.block_size,
            num_waiting=int(load.get("num_waiting", 0)),
            num_running=int(load.get("num_running", 0)),
            kv_usage=float(load.get("kv_usage", 0.0)),
            prefix_caching=bool(load.get("prefix_caching", 1.0)),
            role=self.config.role,
            kv_endpoint=first.kv_endpoint,
            tensor_parallel_size=first.world_size,
            slo_queue_s=load.get("slo_queue_s"),
            slo_admission_rate=load.get("slo_admission_rate"),
            slo_decode_step_s=load.get("slo_decode_step_s"),
            slo_prefill_tokens_per_s=load.get("slo_prefill_tokens_per_s"),
            slo_classes=reported_classes(self.sched.config.slo_class_targets),
            slo_default_class=self.sched.config.slo_default_class,
        )

    def stats(self) -> dict[str, float]:
        stats = dict(self.sched.stats()) if self.sched is not None else {}
        stats.update(
            ready=float(self._workers_up()),
            draining=float(self._drain.draining or self._maintenance.active),
            num_frontends=float(len(self.frontends.frontends)),
            num_workers_ready=float(self.workers.num_ready()),
            num_live_requests=float(len(self.frontends.owners)),
            num_results=float(self._num_steps),
        )
        return stats

    # ---- plans and what the worker link reports (WorkerHost) ---------------------------------

    def _maybe_send_plan(self, back_to_back: bool) -> None:
        """Send plans while the core may have another in flight (one; two with async
        scheduling, the second built while the worker runs the first, or held while the
        dispatch policy says so: `_hold_next`)."""
        self._hold_until = None
        self._send_handover_messages()  # an EndLease goes before any plan reusing its blocks
        while self._workers_up() and not self._stopped and self.sched.can_schedule():
            newest = self.sched.in_flight.newest()
            if newest is not None and self._hold_next(newest):
                return
            started = time.time()
            self.sched.release_held_if_idle()
            plan = self.sched.schedule()
            if plan is None:
                return
            frame = encode(plan)
            sent_at = time.time()
            if not self.workers.send_all(frame):
                return
            self._dispatch.on_path(self._update_s + sent_at - started)
            last = self._last_result_at
            gap = sent_at - last if back_to_back and last else None
            flight = self.sched.in_flight.newest()
            assert flight is not None and flight.plan is plan  # schedule() recorded it
            flight.mark_sent(sent_at, gap)
            back_to_back = False

    # ---- KV hand-over (docs/design/disaggregation.md) ----------------------------------------

    def on_kv_pulled(self, msg: KvPulled) -> None:
        """The worker's answer to a PullKv (a decode engine): the request is admitted."""
        if self.sched is not None:
            self.sched.pull_done(msg)
        self._send_handover_messages()

    def _send_handover_messages(self) -> None:
        """What the hand-over owes the worker (in order, before the next plan) and the
        frontends (each HandoverDone to its request's frontend)."""
        if self.sched is None:
            return
        for msg in self.sched.take_worker_messages():
            self.workers.send_all(encode(msg))
        for done in self.sched.pulls.take_done():
            self.log.info("handover_done", rid=done.rid, ok=done.ok, code=done.code,
                          lease_id=done.source.lease_id, num_blocks=len(done.source.block_ids),
                          num_bytes=done.num_bytes, seconds=done.seconds)  # fmt: skip
            owner = self.frontends.owners.get(done.rid)
            if owner is not None:
                self.frontends.send(owner, done)

    def _hold_next(self, flight: InFlightStep) -> bool:
        """Called with plan N in flight (`flight`, none behind it) before building plan N+1:
        True while the dispatch policy holds it (then `_hold_until` says until when). Step N
        began when its plan left or when result N-1 arrived, whichever came later."""
        started = max(flight.sent_at, self._last_result_at or 0.0)
        plan = flight.plan
        send_at = self._dispatch.send_at(plan.num_scheduled_tokens, _decode_only(plan), started)
        if send_at is None or send_at - time.time() < HOLD_RESOLUTION_S:
            return False
        self._hold_until = send_at
        return True

    def on_workers_ready(self) -> None:
        if self.workers.num_ready() < self.config.num_workers:
            return
        merged = self.workers.merged()
        if self.sched is not None and self._engine_shape != _shape(merged):
            # a different worker (model, pool): requests planned for the old one cannot go on
            message = "the worker came back with a different model or KV pool"
            self.frontends.emit_finals(self.sched.fail_all(ErrorCode.WORKER_FAILED, message))
            self.sched = None
        if self.sched is None:
            self.sched = self._make_scheduler(merged)
            self._engine_shape = _shape(merged)
            # step times are the new worker's to learn
            self._dispatch = DispatchPolicy(enabled=self.sched.config.just_in_time_plans)
        self._worker_lost_at = None
        self.frontends.broadcast(self.ready_message())
        self.log.info(
            "engine_ready", num_blocks=merged.num_blocks, model=self.workers.first().model_name
        )

    def on_result(self, result: StepResult, received_at: float) -> None:
        flight = self.sched.in_flight.oldest() if self.sched is not None else None
        if self.sched is None or flight is None or flight.plan.step_id != result.step_id:
            self.log.warning("stale_result", step_id=result.step_id)
            return
        # step N began when its plan left or when result N-1 arrived, whichever came later
        step_s = received_at - max(flight.sent_at, self._last_result_at or 0.0)
        self._last_result_at = received_at
        self.last_step_id = result.step_id
        self._num_steps += 1
        plan = flight.plan
        self._dispatch.on_result(plan.num_scheduled_tokens, _decode_only(plan), result.forward_s)
        outputs = self.sched.update(result, step_s)  # takes `flight` off the record
        self._update_s = time.time() - received_at
        self.sched.step_completed(flight.rids)  # no suspects of a failed step any more
        # The worker waits for the next plan: send it before logging and emitting outputs.
        self._maybe_send_plan(back_to_back=True)
        self._log_step(flight, result, received_at, len(outputs))
        self.frontends.emit(outputs)
        if self.sched is not None:
            self.sched.after_plan()  # deferred core work, while the worker computes

    def _log_step(self, flight: InFlightStep, result: StepResult, now: float, n_out: int) -> None:
        # converted once, after the next plan has left: the record is not copied on send
        fields = self._step_columns.fields(flight.record, flight.plan, result)
        fields.update(
            step_id=result.step_id,
            num_seqs=flight.plan.num_seqs,
            total_tokens=flight.plan.num_scheduled_tokens,
            num_outputs=n_out,
            t_plan=flight.sent_at,
            t_result=now,
            step_s=now - flight.sent_at,
            forward_s=result.forward_s,
            gap_s=flight.gap_s,
        )
        self.log.info("step", **fields)
        self._summary.on_step(now - flight.sent_at)

    def on_step_failed(self, failure: WorkerFailure) -> None:
        """Only requests of the steps in flight can fail (with overlap, the next plan was built
        on the failed one), and only those the failure is pinned on (bisection:
        services/scheduler/faults.py); the others recompute, and the next plan resets the
        worker's batch. A failure naming another step is stale (with overlap, the plan sent
        behind a failed one fails too). A failure without a step id (the worker could not read
        the plan) counts for the oldest plan in flight, else is only logged."""
        self.log.error(
            "step_failed", step_id=failure.step_id, code=failure.code, message=failure.message
        )
        flight = self.sched.in_flight.oldest() if self.sched is not None else None
        if flight is None or failure.step_id not in (None, flight.plan.step_id):
            return
        assert self.sched is not None  # it holds the flight
        message = f"the worker failed the step: {failure.message}"
        # clears the plans in flight; the rest recompute: held aside or back at the queue's head
        finals = self.sched.bisect_failed_step(ErrorCode.WORKER_FAILED, message)
        failed = [out.rid for out in finals]
        self.log.warning("step_failure_pinned", step_id=flight.plan.step_id,
                         num_seqs=flight.plan.num_seqs, failed_rids=failed)  # fmt: skip
        self.frontends.emit_finals(finals)

    def on_worker_lost(self, reason: str) -> None:
        """Every request the worker held restarts by recompute when a worker is back (or fails
        past `max_retries`); frontends hear EngineNotReady and keep their requests."""
        self.log.error("worker_lost", reason=reason, num_live=len(self.frontends.owners))
        if self.sched is not None:  # clears the plans in flight
            message = f"the worker was lost {self.config.max_retries + 1} times: {reason}"
            finals = self.sched.requeue_all(
                self.config.max_retries, ErrorCode.WORKER_FAILED, message
            )
            self.frontends.emit_finals(finals)
        if self.config.num_workers > 1:  # a tensor-parallel group restarts as a whole
            self.workers.restart_group(f"a rank of the group was lost: {reason}")
        self.workers.forget_ranks()
        if self._worker_lost_at is None:
            self._worker_lost_at = time.monotonic()
        self.frontends.broadcast(EngineNotReady(reason=reason))

    def _check_requeue_timeout(self, now: float) -> None:
        """Requeued requests wait at most `requeue_timeout_s` for a worker."""
        lost_at = self._worker_lost_at
        if lost_at is None or self.sched is None or now - lost_at <= self.config.requeue_timeout_s:
            return
        message = f"no worker came back within {self.config.requeue_timeout_s:g} s"
        self.frontends.emit_finals(self.sched.fail_all(ErrorCode.WORKER_FAILED, message))
        self._worker_lost_at = now  # requests submitted later wait their own full time

    # ---- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        self._summary.maybe_emit(now, lambda: None if self.sched is None else self.sched.stats())
        self._check_requeue_timeout(now)
        if self.sched is not None and (num := self.sched.leases.expire()):
            self.log.warning("leases_expired", num_leases=num)
        self.frontends.check_silence(now)
        if self._maintenance.overdue(now, len(self.frontends.owners)):
            self.frontends.fail_all(ErrorCode.SHUTTING_DOWN, "the engine was drained")
        if self._drain.due(now, len(self.frontends.owners)):
            self._finish_drain()

    def _finish_drain(self) -> None:
        """What is left is dropped without a final output: the frontends hear EngineShutdown
        and resume those requests on another engine (or on this one when it is back)."""
        self.frontends.drop_all("shutdown")
        self.workers.send_all(encode(WorkerShutdown("drained")))
        self.sched = None
        self.frontends.broadcast(EngineShutdown(reason="scheduler stopped"))
        self._stopped = True
