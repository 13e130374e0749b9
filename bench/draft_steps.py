"""Where a never-right draft model's cost goes, per step: one stream of the real model in-process
(the scheduler core driving the model runner, no sockets), `--speculative off` and `draft`
alternating in one command, each step timed apart: the scheduler's part (schedule + update),
the worker's (`execute`), steps with drafts and plain steps (and plain steps right after a
drafted one: a thread pool left spinning by the draft's matmuls would slow those).

    PYTHONPATH=. .venv/bin/python bench/draft_steps.py --rounds 6 --max-tokens 256

The draft: a random 2-layer model of width 64 with the target's vocabulary
(tests/support/tiny_model.py), so ~0% of its drafts are accepted. Greedy, fp32, the default
weights; the prompt is bench/speculation_bench.py's `repeat`. docs/lab/2026-12-draft-model.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.speculation_bench import _prompts
from services.scheduler import Scheduler, SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from services.worker.weights import model_args
from shared.model_files import prepare_model
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from tests.support.tiny_model import write_tiny_model

Step = tuple[float, float, bool, bool]  # scheduler s, worker s, drafted, after a drafted step


def _run(runner: ModelRunner, prompt: list[int], max_tokens: int, rid: str) -> tuple:
    """One request to its end: (tok/s after the first token, the steps after it)."""
    ready = runner.ready_message()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, chunk_size=512,
                             num_speculative_tokens=4)  # fmt: skip
    sched = Scheduler(config, ready.num_blocks, ready.block_size, ready.max_model_len,
                      ready.eos_token_ids, speculative=ready.proposer is not None)  # fmt: skip
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sched.add_request(SubmitRequest(rid, prompt, sampling))
    steps: list[Step] = []
    num_out, first, after = 0, 0.0, False
    while sched.has_work():
        t0 = time.perf_counter()
        plan = sched.schedule()
        assert plan is not None
        t1 = time.perf_counter()
        result = runner.execute(plan)
        t2 = time.perf_counter()
        num_out += sum(len(o.new_token_ids) for o in sched.update(result).as_outputs())
        t3 = time.perf_counter()
        drafted = plan.drafts is not None and bool(plan.drafts.slots)
        if first:
            steps.append((t1 - t0 + t3 - t2, t2 - t1, drafted, after))
        elif num_out:
            first = t3
        after = drafted
    return (num_out - 1) / (time.perf_counter() - first), steps


def _line(mode: str, i: int, rate: float, steps: list[Step]) -> str:
    plain = [s for s in steps if not s[2]]
    drafted = [s[1] for s in steps if s[2]] or [0.0]
    after = [s[1] for s in plain if s[3]] or [0.0]
    med = 1e3 * statistics.median(s[1] for s in plain)
    sched = 1e3 * statistics.mean(s[0] for s in steps)
    return (f"round {i} {mode:5s} {rate:6.1f} tok/s, {len(steps)} steps ({len(steps) - len(plain)}"
            f" drafted): worker per plain step median {med:.2f} ms, right after a drafted step"
            f" {1e3 * statistics.mean(after):.2f}, drafted {1e3 * statistics.mean(drafted):.1f};"
            f" scheduler per step {sched:.3f} ms")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    target = prepare_model(None)
    draft = write_tiny_model(Path(tempfile.mkdtemp()) / "draft",
                             vocab_size=model_args(target).vocab_size)  # fmt: skip
    prompt = AutoTokenizer.from_pretrained(str(target))(_prompts()["repeat"])["input_ids"]
    base = {"dtype": "float32", "kv_cache_memory": 128 << 20, "max_model_len": 2048}
    runners = {"off": ModelRunner(WorkerConfig(**base)),  # type: ignore[arg-type]
               "draft": ModelRunner(WorkerConfig(**base, speculative="draft",  # type: ignore
                                                 draft_model=str(draft)))}  # fmt: skip
    rates: dict[str, list[float]] = {"off": [], "draft": []}
    for i in range(args.rounds):
        for mode in ("off", "draft") if i % 2 == 0 else ("draft", "off"):
            rate, steps = _run(runners[mode], prompt, args.max_tokens, f"r{i}")
            rates[mode].append(rate)
            print(_line(mode, i, rate, steps), flush=True)
    ratios = [d / o for d, o in zip(rates["draft"], rates["off"], strict=True)]
    print(f"draft / off per round {', '.join(f'{r:.2f}' for r in ratios)}; of the means "
          f"{statistics.mean(rates['draft']) / statistics.mean(rates['off']):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
