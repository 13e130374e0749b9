"""The loop every worker process runs (the model worker and the simulated one).

    connect (DEALER, identity "worker-<rank>") -> send WorkerReady
    loop: StepPlan -> runner.execute -> StepResult (rank 0 only), until WorkerShutdown

How plans become answers (at once, or pipelined: step N+1 launched before step N is
finished) is services/worker/steps.py; this module owns the socket, the handshake and the
loop around it. The loop knows no queues of requests: only plans, in order.

Liveness: both ends of the worker socket enable ZeroMQ's own heartbeats (shared/transport.py
`set_heartbeat`). libzmq answers them on its I/O thread, which needs no GIL, so a worker busy in
a long forward pass stays "alive", while a killed, crashed or stopped process drops its
connection: at once when the process dies (the kernel closes the socket), or after
`HEARTBEAT_TIMEOUT_MS` when it hangs as a whole. The scheduler watches its socket's monitor
events for that disconnect (services/scheduler/worker_link.py), so no heartbeat message is
needed.

A runner exception fails only the step: the worker answers `WorkerFailure` and keeps serving,
except FatalWorkerError (a rank of a tensor-parallel group lost or out of step): the worker
exits with EXIT_GROUP_LOST at once (its disconnect is a lost worker to the scheduler, which
retries the requests it held), and so does every rank the scheduler
tells `WorkerShutdown(restart=True)` after losing one of their group; their supervisor
(`conveyor up --restart on-failure`, or compose's restart policy) starts the group again.
Idle for `POLL_MS` after steps, the loop trims the heap (heap.py): RSS stays bounded.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from services.worker.heap import trim_heap
from services.worker.inbox import PlanInbox
from services.worker.steps import (
    PipelinedRunner,
    PipelinedSteps,
    StepRunner,
    Steps,
)
from services.worker.tracing import StepTrace
from shared.curve import make_curve_client, server_public_path, worker_secret_path
from shared.env import env_bool
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import (
    StepPlan,
    StepResult,
    WorkerFailure,
    WorkerShutdown,
    worker_identity,
)
from shared.transport import guarded, set_heartbeat

if TYPE_CHECKING:  # torch: the simulated worker never loads it
    from services.worker.kv_transfer import KvTransfer

EXIT_GROUP_LOST = 3  # exit code: this rank cannot go on without its group; restart the group


def serve_worker(
    runner: StepRunner,
    plan_address: str,
    rank: int,
    log: Any,
    *,
    stop: Optional[threading.Event] = None,
    ready_file: Optional[Path] = None,
    max_frame_bytes: Optional[int] = None,
    context: Optional[zmq.Context] = None,
    curve_keys: Optional[Path] = None,
    trim_heap_when_idle: Optional[bool] = None,
    pipeline: bool = False,
    trace: Optional[StepTrace] = None,
    kv: Optional[KvTransfer] = None,
) -> int:
    """Serve plans from the scheduler at `plan_address` until WorkerShutdown or `stop` is set.

    Called once per worker process, after the runner has loaded the model and sized its KV
    pool. Returns the process exit code (0 on an orderly shutdown). `ready_file`, when given,
    is created after WorkerReady is sent (container healthchecks look at it). `curve_keys`: a
    `conveyor keys generate` folder; the connection is CURVE with its worker key pair (raises
    ValueError on bad key files). `trim_heap_when_idle` (default CONVEYOR_HEAP_TRIM, on): see
    heap.py. `pipeline`: launch plan N+1 before finishing step N (the runner must be a
    PipelinedRunner; see the module docstring). `trace`: step spans (tracing on, rank 0).
    """
    trim = env_bool("HEAP_TRIM", True) if trim_heap_when_idle is None else trim_heap_when_idle
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    if curve_keys is not None:
        try:
            make_curve_client(sock, server_public_path(curve_keys), worker_secret_path(curve_keys))
        except ValueError:
            sock.close()
            raise
    sock.setsockopt(zmq.IDENTITY, worker_identity(rank))
    sock.setsockopt(zmq.LINGER, 1000)
    set_heartbeat(sock)
    # WorkerReady goes out on every completed connection, so that a restarted scheduler (or
    # one that counted this worker lost) hears the handshake again.
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(plan_address)
    greeter = _Greeter(runner, rank, plan_address, log, ready_file, kv)

    send = _sender(sock, trace)
    steps = (
        PipelinedSteps(send, cast(PipelinedRunner, runner), log)
        if pipeline
        else Steps(send, runner, rank, log)
    )
    try:
        return _serve_loop(
            sock, monitor, greeter, steps, log, stop, max_frame_bytes, trim, trace, kv
        )
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        sock.disable_monitor()
        monitor.close()
        sock.close()


def _sender(sock: zmq.Socket, trace: Optional[StepTrace]) -> Callable[[Any], None]:
    """How the steps send their results (and failures); traced, each closes its step span."""

    def send(msg: Any) -> None:
        sock.send(encode(msg))
        if trace is not None and isinstance(msg, StepResult):
            trace.on_result(msg)
        elif trace is not None and isinstance(msg, WorkerFailure) and msg.step_id is not None:
            trace.on_failure(msg.step_id)

    return send


class _Greeter:
    """Sends WorkerReady on each handshake with the scheduler; the first one creates the
    ready file (container healthchecks look at it)."""

    def __init__(
        self,
        runner: StepRunner,
        rank: int,
        address: str,
        log: Any,
        ready_file: Optional[Path],
        kv: Optional[KvTransfer] = None,
    ) -> None:
        self._ready = runner.ready_message(rank=rank)
        if kv is not None and kv.endpoint:  # the scheduler tells frontends where leases wait
            self._ready = dataclasses.replace(self._ready, kv_endpoint=kv.endpoint)
        self._address = address
        self._log = log
        self._ready_file = ready_file
        self.num_handshakes = 0

    def on_monitor(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        while monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)
            if event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                continue
            sock.send(encode(self._ready))
            self.num_handshakes += 1
            r = self._ready
            self._log.info(
                "worker_ready", rank=r.rank, address=self._address, num_blocks=r.num_blocks,
                block_size=r.block_size, max_model_len=r.max_model_len, device=r.device,
                dtype=r.dtype, quantization=r.quantization, kv_cache_dtype=r.kv_cache_dtype,
                kv_cache_bytes=r.kv_cache_bytes, handshake=self.num_handshakes,
            )  # fmt: skip
            if self._ready_file is not None and self.num_handshakes == 1:
                self._ready_file.parent.mkdir(parents=True, exist_ok=True)
                self._ready_file.write_text(self._address + "\n")


def _serve_loop(
    sock: zmq.Socket,
    monitor: zmq.Socket,
    greeter: _Greeter,
    steps: Steps,
    log: Any,
    stop: Optional[threading.Event],
    max_frame_bytes: Optional[int],
    trim: bool,
    trace: Optional[StepTrace],
    kv: Optional[KvTransfer] = None,
) -> int:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    inbox = PlanInbox(sock, max_frame_bytes)
    if kv is not None:
        kv.attach(poller, inbox)  # its reads (prefill) and pulls in flight (decode) wake the loop
    num_steps = 0
    trimmed_at = 0  # num_steps when the heap was last trimmed
    seq_log = _SequenceLog(log)
    while stop is None or not stop.is_set():
        wait_ms = inbox.wait_ms(steps.wait_ms() if kv is None else kv.wait_ms(steps.wait_ms()))
        events = dict(poller.poll(wait_ms))
        if trim and not events and num_steps != trimmed_at and steps.idle():
            trimmed_at = num_steps  # idle after steps: pages to the OS
            trim_heap()
        if monitor in events:
            greeter.on_monitor(sock, monitor)
        if kv is not None:
            _serve_kv(kv, events, sock, log, inbox.ready(events))
        if not inbox.ready(events):
            steps.on_quiet()  # no plan behind the launched step: its result goes now
            continue
        frame = inbox.recv()
        outcome = guarded(
            log,
            "worker_message_failed",
            lambda f: _on_frame(sock, steps, log, f, max_frame_bytes, seq_log, trace, kv),
            frame,
            lambda exc: _send_failure(
                sock, ErrorCode.INTERNAL, f"worker error: {type(exc).__name__}"
            ),
        )
        if outcome == "shutdown":
            log.info("worker_shutdown", num_steps=num_steps)
            return 0
        if outcome == "group_lost":
            log.error("worker_group_lost", num_steps=num_steps, exit_code=EXIT_GROUP_LOST)
            return EXIT_GROUP_LOST
        num_steps += outcome == "step"
    steps.flush()
    log.info("worker_stopped", reason="signal", num_steps=num_steps)
    return 0


def _serve_kv(
    kv: KvTransfer, events: dict[Any, int], sock: zmq.Socket, log: Any, frames_waiting: bool
) -> None:
    """The hand-over's share of a loop turn: reads answered (prefill), pulls whose reply
    landed or timed out answered to the scheduler (decode), steps never waiting for them."""
    guarded(log, "kv_transfer_failed", lambda _: kv.on_events(events), 0)
    kv.tick(time.monotonic(), frames_waiting)
    for answer in kv.take_answers():
        sock.send(encode(answer))


def _send_failure(sock: zmq.Socket, code: str, message: str) -> None:
    sock.send(encode(WorkerFailure(step_id=None, code=code, message=message)))


def _on_frame(
    sock: zmq.Socket,
    steps: Steps,
    log: Any,
    frame: bytes,
    max_frame_bytes: Optional[int],
    seq_log: _SequenceLog,
    trace: Optional[StepTrace] = None,
    kv: Optional[KvTransfer] = None,
) -> str:
    """One frame from the scheduler, answered: "step" (a plan ran), "shutdown", "group_lost"
    (this rank must exit for its group to restart) or "other". Anything but a plan first sends
    the result of a step still in flight, so answers keep the order of the frames."""
    try:
        msg = decode(frame, max_size=max_frame_bytes)
    except DecodeError as exc:
        steps.flush()
        log.error("bad_frame", code=exc.code, message=exc.message)
        sock.send(encode(WorkerFailure(step_id=None, code=exc.code, message=exc.message)))
        return "other"
    if isinstance(msg, StepPlan):
        seq_log.on_plan(msg)
        if trace is not None:
            trace.on_plan(msg)
        return steps.on_plan(msg)
    steps.flush()
    if kv is not None and kv.handles(msg):
        kv.on_message(msg)  # a pull's KvPulled goes out when its reply lands (_serve_kv)
        return "other"
    if isinstance(msg, WorkerShutdown):
        log.info("worker_shutdown_asked", reason=msg.reason, restart=msg.restart)
        return "group_lost" if msg.restart else "shutdown"
    message = f"unexpected message {type(msg).__name__} on the worker channel"
    log.error("bad_message", message=message)
    sock.send(encode(WorkerFailure(step_id=None, code=ErrorCode.UNKNOWN_TYPE, message=message)))
    return "other"


class _SequenceLog:
    """One line per request joining or leaving this worker's batch (`conveyor logs --rid` shows
    them). Plans name released sequences by slot: the slot -> rid map they imply is kept here."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._rids: dict[int, str] = {}

    def on_plan(self, plan: StepPlan) -> None:
        """Called for each plan before it runs."""
        log, step_id = self._log, plan.step_id
        if plan.prev_step_id is None:  # a reset: the batch is dropped whole
            for slot, rid in self._rids.items():
                log.info("sequence_released", rid=rid, slot=slot, step_id=step_id, reset=True)
            self._rids.clear()
        for slot in plan.released_slots:
            log.info("sequence_released", rid=self._rids.pop(slot, None), slot=slot,
                     step_id=step_id)  # fmt: skip
        for seq in plan.new_seqs:
            self._rids[seq.slot] = seq.rid
            log.info(
                "sequence_started",
                rid=seq.rid,
                slot=seq.slot,
                step_id=step_id,
                num_tokens=len(seq.token_ids),
                num_prompt_tokens=seq.num_prompt_tokens,
                num_blocks=len(seq.block_ids),
            )
