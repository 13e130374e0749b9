"""The simulated worker's fault injection (`--sim-fail-token`, services/worker/sim/faults.py)
with overlap scheduling: after a poisoned step fails, the plan already in flight (built on the
failed step) is refused by the batch like on a real worker, not counted as a second fault."""

from __future__ import annotations

import pytest
import structlog
from structlog.testing import capture_logs

from services.worker.plan_writer import PlanWriter
from services.worker.sim.config import SimConfig
from services.worker.sim.faults import FaultInjectingRunner, SimulatedStepFault
from services.worker.sim.runner import SimRunner
from shared.protocol.sampling import SamplingParams

FAIL_TOKEN = 4242
GREEDY = SamplingParams(temperature=0.0)


def _runner() -> FaultInjectingRunner:
    inner = SimRunner(SimConfig(device="none", model="smollm2-135m", num_blocks=64))
    return FaultInjectingRunner(inner, FAIL_TOKEN, structlog.get_logger())


def test_the_plan_in_flight_after_a_fault_is_refused_not_faulted_again() -> None:
    runner = _runner()
    writer = PlanWriter(first_step_id=1)
    good = writer.new_sequence("good", [5, 6, 7], 3, [0], GREEDY)
    bad = writer.new_sequence("bad", [5, FAIL_TOKEN, 7], 3, [1], GREEDY)
    first = writer.plan({"good": 3, "bad": 3}, [good, bad])
    in_flight = writer.plan({"good": 1, "bad": 1})  # sent before the failure was known
    with capture_logs() as logs:
        with pytest.raises(SimulatedStepFault):
            runner.execute(first)
        with pytest.raises(ValueError, match="reset is needed"):
            runner.execute(in_flight)  # the batch refuses it: nothing computes
    assert [e["event"] for e in logs] == ["simulated_step_fault"]
    writer.reset()  # the scheduler's next plan resets the batch, without the culprit
    again = writer.new_sequence("good", [5, 6, 7], 3, [0], GREEDY)
    plan = writer.plan({"good": 3}, [again])
    assert writer.samplers(plan, runner.execute(plan).token_ids, {"good"}).keys() == {"good"}
    plan = writer.plan({"good": 1})  # it goes on from there
    result = runner.execute(plan)
    assert writer.samplers(plan, result.token_ids, {"good"}).keys() == {"good"}
    assert result.step_id == 4
