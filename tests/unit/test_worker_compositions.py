"""Every step composition through the real worker: the scheduler core (two plans in flight)
drives the model runner with a tiny random model, unpipelined and pipelined (the loop's
`PipelinedSteps` in-process, every plan launched on arrival, so a decode forward is launched
behind a prompt forward whose tokens have not landed). Long prompts arrive into running
decodes; every request must give the tokens it gives alone. Runtime ~5 s.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import pytest
from test_scheduler_support import FakeClock

from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.composition import STEP_COMPOSITIONS
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult
from tests.support.plan_driver import PlanDriver
from tests.support.tiny_model import write_tiny_model
from tests.support.two_plan_driver import LockstepWorker

MAX_TOKENS = 8
# rid -> (arrival round, prompt length): two short prompts decode when two long ones arrive
REQUESTS = {"a": (0, 5), "b": (0, 9), "c": (3, 45), "d": (4, 30)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _runner(folder: Path, pipeline: str) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                                    block_size=16, pipeline_steps=pipeline))  # fmt: skip


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(5)
    return {rid: [rng.randrange(3, 250) for _ in range(n)] for rid, (_, n) in REQUESTS.items()}


@pytest.fixture(scope="module")
def alone(tiny: Path) -> dict[str, list[int]]:
    """Each request through `execute`, one at a time: what every composition must reproduce."""
    runner = _runner(tiny, "off")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {}
    for rid, prompt in _prompts().items():
        driver = PlanDriver(runner.execute, runner.kv_cache.num_blocks, 16, chunk_size=16)
        driver.add(rid, prompt, greedy)
        while not driver.seqs[rid].done:
            driver.step([rid])
        out[rid] = driver.seqs[rid].outputs
    return out


def _serve(folder: Path, composition: str, pipeline: str) -> dict[str, list[int]]:
    """The scheduler core over the real runner, two plans in flight when it may send them."""
    runner = _runner(folder, pipeline)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, chunk_size=16,
                             step_composition=composition)  # fmt: skip
    sched = Scheduler(config, runner.kv_cache.num_blocks, 16, runner.max_model_len, [],
                      clock=FakeClock())  # fmt: skip
    lockstep: Optional[LockstepWorker] = LockstepWorker(runner) if pipeline == "on" else None
    answers: list[StepResult] = []

    def send(plan: StepPlan) -> None:
        if lockstep is not None:
            lockstep.send(plan)
        else:
            answers.append(runner.execute(plan))

    prompts, tokens = _prompts(), {rid: [] for rid in REQUESTS}
    for round_no in range(200):
        for rid, (at, _) in REQUESTS.items():
            if at == round_no:
                sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
                assert sched.add_request(SubmitRequest(rid, prompts[rid], sampling)) is None
        while sched.can_schedule() and (plan := sched.schedule()) is not None:
            send(plan)
        if len(sched.in_flight) == 0:
            if round_no > 4 and not sched.has_work():
                break
            continue
        answer = lockstep.recv() if lockstep is not None else answers.pop(0)
        assert isinstance(answer, StepResult), answer
        for out in sched.update(answer).as_outputs():
            tokens[out.rid].extend(out.new_token_ids)
        sched.check_invariants()
    if lockstep is not None:
        lockstep.close()
    assert not sched.has_work()
    return tokens


@pytest.mark.parametrize("composition", STEP_COMPOSITIONS)
def test_each_composition_gives_every_request_its_own_tokens(
    tiny: Path, alone: dict[str, list[int]], composition: str
) -> None:
    for pipeline in ("off", "on"):
        assert _serve(tiny, composition, pipeline) == alone, pipeline
