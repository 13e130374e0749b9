"""Fault injection for the SIMULATED worker (`--sim-fail-token ID`): every step that holds a
sequence whose prompt contains token ID fails, as a real worker fails on an input that breaks
it (a kernel fault, a NaN). Tests use it to check that such a failure is pinned on that request
alone (services/scheduler/faults.py) and that the worker drops every request the scheduler ends.

The step fails before the inner runner sees the plan, so the runner's batch stays at the plan
before; the scheduler's next plan resets the worker's batch (docs/design/step_contract.md). A
plan that the batch would refuse anyway (with async scheduling, the plan sent before the failure
was known, built on the failed step) is not a step: it goes to the inner runner, which refuses
it, as a real worker refuses it without computing; it neither faults nor moves the rid map.
"""

from __future__ import annotations

from typing import Any, Optional

from services.worker.steps import StepRunner
from shared.protocol.worker_channel import StepPlan, StepResult, WorkerReady


class SimulatedStepFault(RuntimeError):
    """What a poisoned step raises (serve_worker answers it with WorkerFailure)."""


class FaultInjectingRunner:
    """Wraps a runner; remembers which live rids are poisoned (their prompt holds the token)."""

    def __init__(self, inner: StepRunner, fail_token_id: int, log: Any) -> None:
        self._inner = inner
        self._token = fail_token_id
        self._log = log
        self._rids: dict[int, str] = {}  # slot -> rid of the worker's batch, as plans tell it
        self._poisoned: set[str] = set()  # held rids whose prompt holds the token
        self._last_step_id: Optional[int] = None  # the plan the batch is at; None: needs a reset

    def ready_message(self, rank: int = 0) -> WorkerReady:
        return self._inner.ready_message(rank=rank)

    def execute(self, plan: StepPlan) -> StepResult:
        """Called once per plan: raises SimulatedStepFault when a poisoned rid computes in it."""
        if plan.prev_step_id is not None and plan.prev_step_id != self._last_step_id:
            return self._inner.execute(plan)  # refused there: the batch is not at prev_step_id
        self._last_step_id = None  # until the inner runner has run it
        if plan.prev_step_id is None:
            self._rids.clear()
        for slot in plan.released_slots:
            self._poisoned.discard(self._rids.pop(slot, ""))
        for seq in plan.new_seqs:
            self._rids[seq.slot] = seq.rid
            if self._token in seq.token_ids[: seq.num_prompt_tokens]:
                self._poisoned.add(seq.rid)
        waiting = {slot for slot, n in zip(plan.count_slots, plan.counts, strict=True) if n == 0}
        in_step = {rid for slot, rid in self._rids.items() if slot not in waiting} & self._poisoned
        if in_step:
            self._log.warning("simulated_step_fault", step_id=plan.step_id, rids=sorted(in_step))
            raise SimulatedStepFault(f"simulated fault: token {self._token} in {sorted(in_step)}")
        result = self._inner.execute(plan)
        self._last_step_id = plan.step_id
        return result
