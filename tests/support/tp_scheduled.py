"""Greedy requests through the real scheduler on a tensor-parallel ModelRunner, for tests of
speculation with several ranks (tests/e2e/test_tensor_parallel.py).

Rank 0 holds the scheduler (as the engine's scheduler would, it learns from rank 0's results)
and hands each plan to the other ranks with a torch.distributed broadcast (the engine sends
every rank the same plan over ZeroMQ); plan N+1 is built before result N is applied (async
scheduling: the scheduler does not know how many of step N's drafts were accepted). One request
is constrained by a regex (rank 0 masks its rows, drafts included, before verifying). Every rank
records, after each step, each held sequence's computed count and history: the ranks must end
every step in the same state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from tokenizers import Tokenizer

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.runner import ModelRunner
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import Constraint, SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult

NUM_REQUESTS = 3
MAX_TOKENS = 24
NUM_DRAFTS = 4  # the scheduler's --num-speculative-tokens
REGEX = r"([A-Z]{3}-[0-9]{2} ){1,3}END"
REGEX_RID = "regex"
# the prompt holds the output's n-grams, so the constrained row drafts; "7Q" the grammar refuses
REGEX_TEXT = "ABC-12 ABC-7Q ABC-12 ABC-12 END"


def _prompt(i: int) -> list[int]:
    """A repeated pattern, so n-grams match and a random model tends to continue it."""
    return [(7 * i + j) % 23 + 40 for j in range(6)] * 3


def _plans(sched: Scheduler, results: deque[StepResult], out: dict[str, list[int]],
           regex_drafts: list[int]) -> Iterator[StepPlan]:  # fmt: skip
    """Plans until every request finished; the caller appends each plan's result. The
    constrained request's drafts (proposed, accepted) go to `regex_drafts` when it ends."""
    while sched.has_work() or results:
        while sched.can_schedule():
            plan = sched.schedule()
            if plan is None:
                break
            yield plan
        assert results, "the scheduler has work but made no plan"
        for output in sched.update(results.popleft()).as_outputs():
            out[output.rid].extend(output.new_token_ids)
            if output.timings is not None and output.rid == REGEX_RID:
                regex_drafts.extend((output.timings.num_draft_tokens,
                                     output.timings.num_accepted_tokens))  # fmt: skip


def _regex_request(model: Path) -> SubmitRequest:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = tokenizer.encode(f"{REGEX_TEXT}\n{REGEX_TEXT}\n").ids
    params = SamplingParams(temperature=0.0, max_tokens=40, constraint=Constraint("regex", REGEX))
    return SubmitRequest(REGEX_RID, prompt, params)


def decoded(model: Path, token_ids: list[int]) -> str:
    """The text of an output (the tiny model's tokenizer)."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def _share(runner: ModelRunner, plan: Optional[StepPlan]) -> Optional[StepPlan]:
    """Rank 0's plan (None: the work is done) on every rank."""
    if runner.group.world_size == 1:
        return plan
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_scheduled(runner: ModelRunner, drafts: bool) -> dict[str, Any]:
    """Every rank must call it. Greedy outputs (rank 0), draft counts (rank 0) and the state
    after every step (every rank); draft limits in the plans only when `drafts`."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    states: list[list[tuple[str, int, list[int]]]] = []

    def execute(plan: StepPlan) -> StepResult:
        result = runner.execute(plan)
        states.append(sorted((s.rid, s.num_computed, list(s.token_ids))
                             for s in runner.held.seqs.values()))  # fmt: skip
        return result

    if runner.group.rank > 0:
        while (plan := _share(runner, None)) is not None:
            execute(plan)
        return {"states": states}
    ready = runner.ready_message()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=16,
                             async_scheduling=True, num_speculative_tokens=NUM_DRAFTS)  # fmt: skip
    sched = Scheduler(config, ready.num_blocks, ready.block_size, ready.max_model_len,
                      ready.eos_token_ids, speculative=drafts)  # fmt: skip
    out: dict[str, list[int]] = {}
    for i in range(NUM_REQUESTS):
        assert sched.add_request(SubmitRequest(f"s{i}", _prompt(i), greedy)) is None
        out[f"s{i}"] = []
    assert sched.add_request(_regex_request(Path(runner.config.model))) is None
    out[REGEX_RID] = []
    results: deque[StepResult] = deque()
    regex_drafts: list[int] = []
    for plan in _plans(sched, results, out, regex_drafts):
        _share(runner, plan)
        results.append(execute(plan))
        sched.check_invariants()
    _share(runner, None)
    stats = sched.stats()
    return {"states": states, "outputs": out,
            "proposed": stats.get("spec_decode_num_draft_tokens", 0.0),
            "accepted": stats.get("spec_decode_num_accepted_tokens", 0.0),
            "regex_drafts": regex_drafts}  # fmt: skip
