"""A scheduler stand-in that keeps two plans in flight, over the real worker socket.

For tests of the worker loop (services/worker/loop.py) with and without step pipelining: the
real `serve_worker` runs in a thread with a real runner, and this driver binds the ROUTER end
of the worker socket. Like the scheduler under `--async-scheduling` it sends plan N+1 before
result N arrives, assuming every request goes on; a request that ends at step N (its stop
token, its length) or is aborted or preempted meanwhile has its sample of step N+1 dropped and
is released by the next plan built (docs/design/step_contract.md, "Overlap"). It is
deliberately simple (every active request computes each step, a chunk of at most `chunk_size`
tokens or one decode); the real policies live in services/scheduler.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import structlog
import zmq

from services.worker.loop import PipelinedRunner, PipelinedSteps, StepRunner, serve_worker
from services.worker.plan_writer import PlanWriter
from shared.protocol.codec import decode, encode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import (
    StepPlan,
    StepResult,
    WorkerFailure,
    WorkerReady,
    WorkerShutdown,
)
from tests.support.plan_driver import BlockAllocator

RECV_TIMEOUT_MS = 120_000  # one step of the real model on a busy 2-core machine is < 1 s


@dataclass
class Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    outputs: list[int] = field(default_factory=list)  # landed samples
    num_computed: int = 0  # as scheduled (plans sent)
    num_in_flight: int = 0  # samples of plans sent, not yet back
    block_ids: list[int] = field(default_factory=list)
    held: bool = False  # the worker holds it (else the next plan sends a NewSequence)
    epoch: int = 0  # bumped when preempted or reset: samples of older plans are dropped
    ended: Optional[str] = None  # "stop", "length", "abort"

    @property
    def active(self) -> bool:
        return self.ended is None


@dataclass
class _Sent:
    plan: StepPlan
    samplers: list[tuple[str, int]]  # (rid, epoch), in the worker's batch order
    expect_failure: bool


class SocketWorker:
    """The real worker loop (`serve_worker`) in a thread, over a real socket; this end binds
    the scheduler's ROUTER. Answers come whenever the loop sends them."""

    def __init__(self, runner: StepRunner, pipeline: bool) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.exit_code: Optional[int] = None
        log = structlog.get_logger().bind(service="worker")

        def serve() -> None:
            self.exit_code = serve_worker(
                runner, f"tcp://127.0.0.1:{port}", 0, log, stop=self.stop, context=self.ctx,
                trim_heap_when_idle=False, pipeline=pipeline,
            )  # fmt: skip

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        frames = self.sock.recv_multipart()
        self.identity = frames[0]
        if not isinstance(decode(frames[1]), WorkerReady):
            raise AssertionError(f"expected WorkerReady, got {frames[1]!r}")

    def send(self, plan: StepPlan) -> None:
        self.sock.send_multipart([self.identity, encode(plan)])

    def recv(self) -> Any:
        return decode(self.sock.recv_multipart()[1])

    def close(self) -> None:
        self.sock.send_multipart([self.identity, encode(WorkerShutdown(reason="test"))])
        self.thread.join(timeout=30)
        self.stop.set()
        self.thread.join(timeout=30)
        self.sock.close(linger=0)
        self.ctx.term()
        if self.exit_code != 0:
            raise AssertionError(f"the worker loop exited with {self.exit_code}")


class LockstepWorker:
    """The loop's pipelined step handling (`PipelinedSteps`) called in-process: each plan is
    launched as it is sent, so with two plans in flight step N+1 is always launched before
    step N is finished (over a socket that depends on timing). Answers queue up in order."""

    def __init__(self, runner: PipelinedRunner) -> None:
        self.answers: deque[Any] = deque()
        log = structlog.get_logger().bind(service="worker")
        self.steps = PipelinedSteps(self.answers.append, runner, log)

    def send(self, plan: StepPlan) -> None:
        self.steps.on_plan(plan)

    def recv(self) -> Any:
        if not self.answers:
            self.steps.flush()  # nothing behind the launched step: the loop finishes it
        return self.answers.popleft()

    def close(self) -> None:
        self.steps.flush()
        if self.answers:
            raise AssertionError(f"answers nobody asked for: {list(self.answers)}")


class TwoPlanDriver:
    """Drives a worker (SocketWorker or LockstepWorker); `run` returns rid -> output ids."""

    def __init__(
        self, worker: SocketWorker | LockstepWorker, num_blocks: int, block_size: int,
        chunk_size: int,
    ) -> None:  # fmt: skip
        self.worker = worker
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks = BlockAllocator(num_blocks, shuffle_seed=3)
        self.writer = PlanWriter()
        self.requests: dict[str, Request] = {}
        self.to_release: list[str] = []
        self.in_flight: deque[_Sent] = deque()
        self.num_failures = 0
        self.num_steps = 0

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams,
            stop_ids: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.requests[rid] = Request(rid, list(prompt), sampling, stop_ids)

    # --- events a test injects between steps -------------------------------------------------

    def abort(self, rid: str) -> None:
        self._end(self.requests[rid], "abort")

    def preempt(self, rid: str) -> None:
        """Drop its KV and in-flight samples; it resumes later with prompt + landed outputs."""
        self._drop(self.requests[rid])

    # --- the loop ------------------------------------------------------------------------------

    def run(
        self,
        on_step: Optional[Callable[[TwoPlanDriver, int], None]] = None,
        spoil: frozenset[int] = frozenset(),
        max_steps: int = 10_000,
    ) -> dict[str, list[int]]:
        """Step until every request ended. `on_step(driver, n)` runs before building plan n;
        plans whose number is in `spoil` are sent with a wrong token count (the worker must
        refuse them, and every plan after them until a reset)."""
        for n in range(max_steps):
            if on_step is not None:
                on_step(self, n)
            if self._has_work():
                self._send_plan(spoil=n in spoil)
            if len(self.in_flight) == 2 or (self.in_flight and not self._has_work()):
                self._take_answer()
            elif not self.in_flight and not self._has_work():
                break
        while self.in_flight:
            self._take_answer()
        return {rid: r.outputs for rid, r in self.requests.items()}

    def _has_work(self) -> bool:
        return any(self._wants(r) for r in self.requests.values()) or bool(self.to_release)

    def _wants(self, req: Request) -> bool:
        return req.active and len(req.outputs) + req.num_in_flight < req.sampling.max_tokens

    def _send_plan(self, spoil: bool) -> None:
        new_seqs, scheduled, appended, samplers = [], {}, {}, []
        for req in self.requests.values():
            if not self._wants(req):
                continue
            history = len(req.prompt) + len(req.outputs) + req.num_in_flight
            n = min(self.chunk_size, history - req.num_computed)
            need = -(-(req.num_computed + n) // self.block_size) - len(req.block_ids)
            added = self.blocks.take(max(need, 0))
            req.block_ids.extend(added)
            if not req.held:
                new_seqs.append(self.writer.new_sequence(
                    req.rid, req.prompt + req.outputs, len(req.prompt), req.block_ids,
                    req.sampling, req.num_computed,
                ))  # fmt: skip
                req.held = True
            elif added:
                appended[req.rid] = added
            scheduled[req.rid] = n
            req.num_computed += n
            if req.num_computed == history:
                req.num_in_flight += 1
                samplers.append(req.rid)
        plan = self.writer.plan(scheduled, new_seqs, appended, self.to_release)
        self.to_release = []
        order = [(rid, self.requests[rid].epoch) for rid in self.writer.slots if rid in samplers]
        if spoil:
            plan = dataclasses.replace(plan, num_scheduled_tokens=plan.num_scheduled_tokens + 1)
        self.worker.send(plan)
        self.in_flight.append(_Sent(plan, order, spoil))
        self.num_steps += 1

    def _take_answer(self) -> None:
        sent = self.in_flight.popleft()
        msg = self.worker.recv()
        if isinstance(msg, WorkerFailure):
            if msg.step_id != sent.plan.step_id:
                raise AssertionError(f"failure for step {msg.step_id}, expected {sent.plan}")
            self.num_failures += 1
            self._reset()
            return
        if not isinstance(msg, StepResult) or msg.step_id != sent.plan.step_id:
            raise AssertionError(f"expected the result of step {sent.plan.step_id}, got {msg!r}")
        if sent.expect_failure:
            raise AssertionError(f"step {msg.step_id} had a wrong count and was computed")
        if len(msg.token_ids) != len(sent.samplers):
            raise AssertionError(f"{len(msg.token_ids)} tokens for {len(sent.samplers)} samplers")
        for (rid, epoch), tok in zip(sent.samplers, msg.token_ids, strict=True):
            req = self.requests[rid]
            if epoch != req.epoch:
                continue  # preempted or reset since: recomputed later
            req.num_in_flight -= 1
            if not req.active:
                continue  # ended at an earlier step: this extra sample is dropped
            req.outputs.append(tok)
            if tok in req.stop_ids:
                self._end(req, "stop")
            elif len(req.outputs) >= req.sampling.max_tokens:
                self._end(req, "length")

    def _end(self, req: Request, why: str) -> None:
        if req.ended is None:
            req.ended = why
            self._drop(req)

    def _drop(self, req: Request) -> None:
        """Release its slot and blocks in the next plan; samples in flight are dropped."""
        if req.held:
            self.to_release.append(req.rid)
        self.blocks.give_back(req.block_ids)
        req.block_ids, req.num_computed, req.held = [], 0, False
        req.num_in_flight = 0
        req.epoch += 1

    def _reset(self) -> None:
        """A failed step: the worker holds nothing; answers to the plans still in flight are
        failures too (they extend the failed step)."""
        while self.in_flight:
            sent = self.in_flight.popleft()
            msg = self.worker.recv()
            if not isinstance(msg, WorkerFailure) or msg.step_id != sent.plan.step_id:
                raise AssertionError(f"step {sent.plan.step_id} after a failure answered {msg!r}")
            self.num_failures += 1
        for req in self.requests.values():
            req.held = False  # the next plan is a reset: every request is sent again
            self._drop(req)
        self.to_release = []
        self.writer.reset()
