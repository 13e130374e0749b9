"""Step pipelining (`pipeline_steps`): the worker launches step N+1 before step N's tokens land,
its decodes reading step N's tokens on the device. Forced on, on CPU (where "auto" keeps it
off), the real worker loop (services/worker/loop.py) and a tiny random model must give the very
tokens the unpipelined worker gives, with two plans in flight: prefill chunks, decodes, stop
tokens and lengths ending requests mid-flight, an abort, a preemption, refused plans (the
batch then reset), and rows that need the host path (penalties, seeded draws). Runtime ~10 s.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import pytest

from services.worker.config import WorkerConfig, pipelines_steps
from services.worker.pipeline import OverlapRule
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from tests.support.plan_driver import PlanDriver
from tests.support.tiny_model import write_tiny_model
from tests.support.two_plan_driver import LockstepWorker, SocketWorker, TwoPlanDriver

MAX_TOKENS = 14


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _runner(folder: Path, pipeline: str, overlap: Optional[OverlapRule] = None) -> ModelRunner:
    return ModelRunner(WorkerConfig(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                                    block_size=16, pipeline_steps=pipeline),
                       overlap=overlap)  # fmt: skip


def _not_paying() -> OverlapRule:
    """The rule as it stands after a step whose host work was 0% of its forward."""
    rule = OverlapRule(forced=False)
    rule.on_step(0.0, 1.0)
    assert not rule.overlaps()
    return rule


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(11)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # rows on the host path (penalties read the histories; seeded draws): while they run,
    # steps land their tokens before the next is built; short, so most steps stay on the device
    params = [greedy] * 6 + [
        SamplingParams(temperature=0.0, repetition_penalty=1.4, max_tokens=4),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=6),
    ]
    # prompts of 1-3 chunks of 16 tokens, so prefills and decodes share steps
    return {
        f"r{i}": ([rng.randrange(3, 265) for _ in range(rng.randint(3, 45))], p)
        for i, p in enumerate(params)
    }


def _alone(folder: Path) -> dict[str, list[int]]:
    """Each request through `execute`, one at a time: what every schedule must reproduce."""
    runner = _runner(folder, "off")
    driver = PlanDriver(runner.execute, runner.kv_cache.num_blocks, 16, chunk_size=16)
    for rid, (prompt, params) in _requests().items():
        driver.add(rid, prompt, params)
    for rid in driver.seqs:
        while not driver.seqs[rid].done:
            driver.step([rid])
    return {rid: s.outputs for rid, s in driver.seqs.items()}


def _drive(folder: Path, mode: str, stops: dict[str, int], events: bool):
    """mode: "off" (the loop runs each plan at once), "on" (the loop pipelines, over a socket:
    how often step N+1 is launched before step N finishes depends on timing), "lockstep"
    (the loop's pipelined handling called in-process: every plan launched on arrival) or
    "not-paying" (lockstep with a rule that says launching ahead does not pay: every launched
    step is finished at once). In-process, the worker's invariants are checked between steps."""
    overlap = _not_paying() if mode == "not-paying" else None
    runner = _runner(folder, "off" if mode == "off" else "on", overlap)
    in_process = mode in ("lockstep", "not-paying")
    worker = LockstepWorker(runner) if in_process else SocketWorker(runner, mode == "on")
    driver = TwoPlanDriver(worker, runner.kv_cache.num_blocks, 16, 16)
    try:
        for rid, (prompt, params) in _requests().items():
            driver.add(
                rid, prompt, params, frozenset([stops[rid]]) if rid in stops else frozenset()
            )

        def on_step(d: TwoPlanDriver, n: int) -> None:
            if isinstance(worker, LockstepWorker):
                pending = worker.steps.in_flight
                runner.check_invariants([] if pending is None else [pending])  # type: ignore[list-item]
            if events and n == 6:
                d.abort("r1")  # two plans in flight, both computing it
            if events and n == 9:
                d.preempt("r2")  # its sample of the plan in flight is dropped, recomputed later

        outputs = driver.run(on_step, spoil=frozenset({12}) if events else frozenset())
        ended = {rid: r.ended for rid, r in driver.requests.items()}
        return outputs, ended, driver.num_failures, runner.num_device_inputs
    finally:
        worker.close()


@pytest.mark.parametrize("events", [False, True], ids=["steady", "abort-preempt-refused"])
def test_pipelined_worker_gives_the_same_tokens(tiny: Path, events: bool) -> None:
    alone = _alone(tiny)
    # stop tokens that fire mid-way: the first output from the 4th on not seen before
    cut = {rid: i for rid in ("r0", "r3", "r4", "r5") if (i := _first_new(alone[rid], 3))}
    assert len(cut) >= 2
    stops = {rid: alone[rid][i] for rid, i in cut.items()}
    off = _drive(tiny, "off", stops, events)
    on = _drive(tiny, "on", stops, events)
    lockstep = _drive(tiny, "lockstep", stops, events)
    not_paying = _drive(tiny, "not-paying", stops, events)
    assert on[:3] == off[:3] == lockstep[:3] == not_paying[:3]  # outputs, endings, failures
    assert off[3] == 0 and lockstep[3] > 10  # decodes read from the previous step's tensor
    assert not_paying[3] == 0  # each step finished before the next was launched
    outputs, ended, failures, _ = lockstep
    for rid, got in outputs.items():  # every token is the one the request computes alone
        assert got == alone[rid][: len(got)], rid
        if ended[rid] == "length":
            assert len(got) == len(alone[rid]), rid
    for rid, i in cut.items():
        assert ended[rid] == "stop" and outputs[rid] == alone[rid][: i + 1], rid
    if events:
        assert ended["r1"] == "abort" and 0 < len(outputs["r1"]) < MAX_TOKENS
        assert ended["r2"] == "length"  # resumed after preemption and after the reset
        assert failures == 2  # the refused plan and the one sent behind it
    else:
        assert failures == 0


def _first_new(tokens: list[int], start: int) -> Optional[int]:
    """The first index from `start` on (not the last) whose token did not occur before."""
    return next((i for i in range(start, len(tokens) - 1) if tokens[i] not in tokens[:i]), None)


def test_pipeline_mode_resolution() -> None:
    assert not pipelines_steps(WorkerConfig(), 1)  # auto on CPU: today's synchronous path
    assert pipelines_steps(WorkerConfig(device="cuda"), 1)
    assert not pipelines_steps(WorkerConfig(device="cuda"), 2)  # tensor parallel: off
    assert pipelines_steps(WorkerConfig(pipeline_steps="on"), 1)
    assert not pipelines_steps(WorkerConfig(device="cuda", pipeline_steps="off"), 1)
    with pytest.raises(ValueError, match="single rank"):
        pipelines_steps(WorkerConfig(pipeline_steps="on"), 2)
    with pytest.raises(ValueError, match="pipeline_steps must be one of"):
        WorkerConfig(pipeline_steps="yes")  # type: ignore[arg-type]


def test_unpipelined_runner_refuses_launch(tiny: Path) -> None:
    runner = _runner(tiny, "auto")
    assert not runner.pipelining
    with pytest.raises(ValueError, match="pipeline_steps on"):
        runner.launch(None, None)  # type: ignore[arg-type]
