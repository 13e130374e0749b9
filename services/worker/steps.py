"""How the worker loop turns plans into answers: a runner's protocol, and the two ways to run it.

`Steps`: each plan runs to its result at once (`runner.execute`). `PipelinedSteps` (a runner
with launch/finish/discard: the real worker where pipelining pays, services/worker/pipeline.py):
a plan is launched (queued on the device), and its result is sent when the next plan has been
launched behind it, or at once when no plan is waiting by the time the device has finished it,
or at once when the runner says launching ahead does not pay now (`overlaps`). Results leave in
plan order; so the device gets step N+1 before the worker waits for step N's tokens. A plan
refused while step N is in flight is answered after step N's result; a step N whose tokens
cannot be landed fails, and so does step N+1 launched on it (discarded, never reported as
computed): the scheduler then sends a reset plan.

A runner exception fails only the step (a `WorkerFailure`), except FatalWorkerError (a rank
of a tensor-parallel group lost or out of step): the loop then exits (services/worker/loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import StepPlan, StepResult, WorkerFailure, WorkerReady

POLL_MS = 500  # how often the loop looks at its stop event while idle


class FatalWorkerError(Exception):
    """Raised by a runner when it cannot serve any further step (a tensor-parallel peer lost,
    a collective timed out, a rank out of step): the loop fails the step and exits."""


class StepRunner(Protocol):
    """What serve_worker drives: the model worker's ModelRunner (services/worker/runner.py) or
    the simulated worker's SimRunner (services/worker/sim/runner.py, a cost model in place of
    the forward pass). Both move the same held batch (held_batch.py) by each plan."""

    def ready_message(self, rank: int = 0) -> WorkerReady: ...

    def execute(self, plan: StepPlan) -> StepResult: ...


class Launched(Protocol):
    """A step a PipelinedRunner launched: its id, and whether finishing it would wait."""

    @property
    def step_id(self) -> int: ...

    def device_done(self) -> bool: ...


class PipelinedRunner(StepRunner, Protocol):
    """A runner that can launch step N+1 before finishing step N (services/worker/runner.py).
    The loop holds the launched steps (one record of what is in flight) and hands the step
    launched before to `launch`; each launched step is finished or discarded once, in order."""

    def launch(self, plan: StepPlan, prev: Optional[Any]) -> Launched: ...

    def finish(self, launched: Any) -> StepResult: ...

    def discard(self, launched: Any) -> None: ...

    def overlaps(self) -> bool: ...


class Steps:
    """Runs each plan to its result at once (`runner.execute`); `send` gets each answer
    (a StepResult or a WorkerFailure), in plan order."""

    def __init__(
        self, send: Callable[[Any], None], runner: StepRunner, rank: int, log: Any
    ) -> None:
        self._send = send
        self._runner = runner
        self._rank = rank
        self._log = log

    def on_plan(self, plan: StepPlan) -> str:
        """Run one plan and answer it: "step", or "group_lost" when its failure is fatal."""
        reply, fatal = _run_step(self._runner, plan, self._log)
        if fatal:  # no WorkerFailure: the exit itself tells the scheduler (requests are retried)
            return "group_lost"
        # Only rank 0 answers with results; every rank reports its own failures.
        if self._rank == 0 or isinstance(reply, WorkerFailure):
            self._send(reply)
        return "step"

    def wait_ms(self) -> int:
        """How long the loop may wait for the next frame."""
        return POLL_MS

    def idle(self) -> bool:
        """No step in flight."""
        return True

    def on_quiet(self) -> None:
        """The loop's wait ended without a frame."""

    def flush(self) -> None:
        """Send what is still owed (before any other answer, and on exit)."""


class PipelinedSteps(Steps):
    """Keeps one launched step in flight: its result is sent once the next plan is launched
    behind it, or once the device is done with it and no plan is waiting. One rank only
    (`pipeline_steps` refuses tensor parallelism), so rank 0 answers everything."""

    WAIT_MS = 1  # poll step while the device runs the launched step: how late its result may go

    def __init__(self, send: Callable[[Any], None], runner: PipelinedRunner, log: Any) -> None:
        super().__init__(send, runner, 0, log)
        self._pipe = runner
        self._pending: Optional[Launched] = None  # launched, its result not sent yet

    @property
    def in_flight(self) -> Optional[Launched]:
        """The step launched and not finished (read-only: tests check the runner against it)."""
        return self._pending

    def on_plan(self, plan: StepPlan) -> str:
        """Launch the plan, then answer the step launched before it (if any); answer the new
        one at once too when launching ahead does not pay now (`runner.overlaps`)."""
        prev, self._pending = self._pending, None
        try:
            launched = self._pipe.launch(plan, prev)
        except Exception as exc:  # noqa: BLE001 - any runner fault must reach the scheduler
            if prev is not None:
                self._finish(prev)  # step N's result (or failure) first
            return self._fail(plan.step_id, exc)
        if prev is not None and not self._finish(prev):
            self._pipe.discard(launched)  # it read step N's tokens: nothing of it is reported
            why = RuntimeError(f"step {plan.step_id} was launched on failed step {prev.step_id}")
            return self._fail(plan.step_id, why)
        if self._pipe.overlaps():
            self._pending = launched
        else:
            self._finish(launched)
        return "step"

    def wait_ms(self) -> int:
        if self._pending is None:
            return POLL_MS
        return 0 if self._pending.device_done() else self.WAIT_MS

    def idle(self) -> bool:
        return self._pending is None

    def on_quiet(self) -> None:
        if self._pending is not None and self._pending.device_done():
            self.flush()

    def flush(self) -> None:
        prev, self._pending = self._pending, None
        if prev is not None:
            self._finish(prev)

    def _finish(self, launched: Launched) -> bool:
        """Send a launched step's result, or its failure; whether it succeeded."""
        try:
            result = self._pipe.finish(launched)
        except Exception as exc:  # noqa: BLE001 - any runner fault must reach the scheduler
            self._fail(launched.step_id, exc)
            return False
        self._send(result)
        return True

    def _fail(self, step_id: int, exc: Exception) -> str:
        self._log.error("step_failed", step_id=step_id, error=repr(exc))
        failure = WorkerFailure(step_id=step_id, code=ErrorCode.WORKER_FAILED, message=repr(exc))
        self._send(failure)
        return "group_lost" if isinstance(exc, FatalWorkerError) else "step"


def _run_step(
    runner: StepRunner, plan: StepPlan, log: Any
) -> tuple[StepResult | WorkerFailure, bool]:
    """One plan -> (its result, whether the failure is fatal); any runner error becomes a
    WorkerFailure for that step."""
    try:
        return runner.execute(plan), False
    except Exception as exc:  # noqa: BLE001 - any runner fault must reach the scheduler
        log.exception("step_failed", step_id=plan.step_id, error=repr(exc))
        failure = WorkerFailure(
            step_id=plan.step_id, code=ErrorCode.WORKER_FAILED, message=repr(exc)
        )
        return failure, isinstance(exc, FatalWorkerError)
