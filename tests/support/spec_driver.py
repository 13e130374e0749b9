"""The scheduler core driving a worker runner in-process with speculation, as the worker loop
would (tests only): one plan in flight, or two (each result one plan late, as with
`--async-scheduling`), `check_invariants()` after every schedule and update."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult, TokenLogprobs, WorkerReady


class Runner(Protocol):
    def ready_message(self, rank: int = 0) -> WorkerReady: ...

    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass
class SpecRun:
    """What a driven run produced, per rid: tokens, logprobs (when asked), drafts accepted
    (the final output's timings)."""

    sched: Scheduler
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)


def tiny_runner(tiny: Path, speculative: str, draft_model: Optional[Path] = None) -> ModelRunner:
    """The tiny model in fp32 with `speculative` (off, ngram, draft)."""
    return ModelRunner(WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=8 << 20,
                                    block_size=4, speculative=speculative,
                                    draft_model=draft_model and str(draft_model)))  # fmt: skip


def scheduler_for(runner: Runner, config: SchedulerConfig) -> Scheduler:
    """A scheduler sized by the runner's handshake, speculating when the runner proposes."""
    ready = runner.ready_message()
    return Scheduler(config, ready.num_blocks, ready.block_size, ready.max_model_len,
                     ready.eos_token_ids, speculative=ready.proposer is not None)  # fmt: skip


def drive(
    runner: Runner,
    sched: Scheduler,
    requests: list[tuple[list[int], SamplingParams]],
    two_in_flight: bool,
) -> SpecRun:
    """All `requests` (rids r0, r1, ...) at once, to their ends."""
    run = SpecRun(sched)
    for i, (prompt, params) in enumerate(requests):
        assert sched.add_request(SubmitRequest(f"r{i}", prompt, params)) is None
        run.tokens[f"r{i}"] = []
    results: deque[StepResult] = deque()
    while sched.has_work() or results:
        while sched.can_schedule() and (two_in_flight or not results):
            plan = sched.schedule()
            if plan is None:
                break
            results.append(runner.execute(plan))
            sched.check_invariants()
        for out in sched.update(results.popleft()).as_outputs():
            run.tokens[out.rid].extend(out.new_token_ids)
            run.logprobs.setdefault(out.rid, []).extend(out.logprobs)
            if out.timings is not None:  # the final output: its drafts, counted
                run.accepted[out.rid] = out.timings.num_accepted_tokens
        sched.check_invariants()
    return run
