"""One rank of a tensor-parallel ModelRunner as its own process, for tests of the sharded model.

    python -m tests.support.tp_rank --model DIR --rank R --world-size N \
        --dist-init tcp://127.0.0.1:PORT --out DIR [--attention-backend torch]

Runs the same fixed work on every rank (`run_work`) and writes `rank<R>.pt`: the WorkerReady
fields, the float32 logits of every sampled row (rank 0 only; teacher-forced plans, so they do
not depend on any sampling), the greedy outputs of a second set of requests run through
`execute` (sampling on rank 0, tokens broadcast) and each request's token history as this rank
recorded it, and greedy requests through the real scheduler (tests/support/tp_scheduled.py; with
draft limits when `--speculative` is on). World size 1 runs in-process too (`run_work` with
parallel=None): the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from services.worker.config import ParallelConfig, WorkerConfig
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult
from tests.support.plan_driver import PlanDriver
from tests.support.tp_scheduled import run_scheduled

PROMPT_LENS = (5, 19, 33)  # chunked at 8: prefill chunks, a mixed step, then decodes
NUM_OUTPUTS = 6
QUICK = {"prompt_lens": (5, 19), "num_outputs": 3, "scheduled": False}  # Triton interpreter
NUM_BLOCKS = 64  # the same block ids on every world size (a rank's pool holds more)


def worker_config(
    model: str, attention_backend: str, speculative: str = "off", draft: Optional[str] = None
) -> WorkerConfig:
    return WorkerConfig(model=model, dtype="float32", kv_cache_memory=8 << 20,
                        max_model_len=256, attention_backend=attention_backend,
                        speculative=speculative, draft_model=draft)  # type: ignore[arg-type]  # fmt: skip


def _prompts(vocab_size: int, offset: int, lens: tuple[int, ...]) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1234 + offset)
    return {
        f"r{offset}-{i}": torch.randint(3, vocab_size, (n,), generator=gen).tolist()
        for i, n in enumerate(lens)
    }


def run_work(
    runner: ModelRunner,
    prompt_lens: tuple[int, ...] = PROMPT_LENS,
    num_outputs: int = NUM_OUTPUTS,
    scheduled: bool = True,
) -> dict[str, Any]:
    """The fixed work; every rank must call it (the forward passes are collectives)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=num_outputs, ignore_eos=True)
    vocab = runner.args.vocab_size
    logits: list[torch.Tensor] = []

    def teacher(plan: StepPlan) -> StepResult:
        out = runner.compute_logits(plan)  # [B, V] on rank 0, None on the others
        step = runner.last_tool_step
        assert step is not None
        if out is not None:
            logits.append(out[torch.tensor(step.sample, dtype=torch.bool)])  # [S, V]
        num_sampled = sum(step.sample)
        forced = [(plan.step_id * 31 + 7 * i) % (vocab - 3) + 3 for i in range(num_sampled)]
        runner.record_tokens(forced)  # every rank: the next decodes compute these tokens
        return StepResult(step_id=plan.step_id, token_ids=forced)

    forced = PlanDriver(teacher, NUM_BLOCKS, runner.kv_cache.block_size, 8, shuffle_seed=3)
    for rid, ids in _prompts(vocab, 0, prompt_lens).items():
        forced.add(rid, ids, greedy)
    forced.run()
    histories: dict[str, list[int]] = {}

    def execute(plan: StepPlan) -> StepResult:
        result = runner.execute(plan)
        # each request's history as this rank holds it after the step (released ones last)
        histories.update({s.rid: list(s.token_ids) for s in runner.held.seqs.values()})
        return result

    sampled = PlanDriver(execute, NUM_BLOCKS, runner.kv_cache.block_size, 8, 4)
    for rid, ids in _prompts(vocab, 1, prompt_lens).items():
        sampled.add(rid, ids, greedy)
    outputs = sampled.run()
    return {
        "ready": dataclasses.asdict(runner.ready_message(rank=runner.group.rank)),
        "logits": logits,
        "greedy": outputs,
        "histories": {rid: histories.get(rid) for rid in outputs},
        # through the scheduler, with drafts when the runner speculates
        "scheduled": _scheduled(runner) if scheduled else None,
    }


def _scheduled(runner: ModelRunner) -> dict[str, Any]:
    return run_scheduled(runner, drafts=runner.config.speculative != "off")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--dist-init", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--attention-backend", default="torch")
    p.add_argument("--quick", action="store_true", help="less work (QUICK)")
    p.add_argument("--speculative", default="off", help="the worker's --speculative")
    p.add_argument("--draft-model", default=None, help="the worker's --draft-model")
    args = p.parse_args(argv)
    parallel = ParallelConfig(args.rank, args.world_size, args.dist_init, 20.0)
    config = worker_config(args.model, args.attention_backend, args.speculative, args.draft_model)
    runner = ModelRunner(config, parallel=parallel)
    work = run_work(runner, **QUICK) if args.quick else run_work(runner)  # type: ignore[arg-type]
    torch.save(work, args.out / f"rank{args.rank}.pt")
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
