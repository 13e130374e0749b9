"""One stream of the real model, in-process (the scheduler core driving the model runner, no
sockets): output tok/s after the first token with `--speculative ngram` and without, runs
alternating in one command, and whether the texts are equal.

    PYTHONPATH=. .venv/bin/python bench/speculation_bench.py --rounds 3

Workloads: `repeat` (a text given twice, which the model goes on repeating: a verbatim copy) and
`instruct` (asked to copy a text: SmolLM2-135M writes new text instead, so this is the
n-gram proposer on ordinary output), and `json` (asked to copy a JSON list of records under its
json_schema: structured outputs, each verified row masked by the grammar; ends when the JSON
does). Greedy, `--max-tokens` each. The natural-text workloads
through the whole engine: `conveyor bench --scenarios copy,edit,quote` (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.model_files import prepare_model
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import Constraint, SamplingParams

SOURCE = Path(__file__).resolve().parent.parent / "services" / "scheduler" / "request.py"


PEOPLE = [
    {"name": n, "city": c, "age": a}
    for n, c, a in [("Ada Lovelace", "London", 36), ("Alan Turing", "Wilmslow", 41),
                    ("Grace Hopper", "Arlington", 85), ("Edsger Dijkstra", "Nuenen", 72),
                    ("Barbara Liskov", "Cambridge", 84), ("Donald Knuth", "Stanford", 86)]
]  # fmt: skip
PEOPLE_SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                       "age": {"type": "integer"}},
        "required": ["name", "city", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}  # fmt: skip


def _prompts() -> dict[str, tuple[str, Optional[Constraint]]]:
    text = SOURCE.read_text()
    people = json.dumps({"people": PEOPLE})
    return {
        "repeat": (f"{text[:700]}\n\n{text[:700]}\n\n", None),
        "instruct": (f"Copy the following text exactly.\n\n{text[:1400]}\n\nCopy:\n\n", None),
        "json": (
            f"Copy this JSON exactly.\n\n{people}\n\nCopy:\n\n",
            Constraint("json_schema", json.dumps(PEOPLE_SCHEMA)),
        ),  # fmt: skip
    }


def _run(
    runner: ModelRunner, prompt: list[int], args: argparse.Namespace, rid: str,
    constraint: Optional[Constraint],
) -> tuple:  # fmt: skip
    """One request to its end: (tokens, tok/s after the first, steps, drafts, accepted)."""
    ready = runner.ready_message()
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, chunk_size=512,
                             num_speculative_tokens=args.k)  # fmt: skip
    sched = Scheduler(config, ready.num_blocks, ready.block_size, ready.max_model_len,
                      ready.eos_token_ids, speculative=ready.proposer is not None)  # fmt: skip
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                              ignore_eos=constraint is None, constraint=constraint)  # fmt: skip
    sched.add_request(SubmitRequest(rid, prompt, sampling))
    out: list[int] = []
    first, steps = 0.0, 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        result = runner.execute(plan)
        steps += 1
        for o in sched.update(result).as_outputs():
            out += o.new_token_ids
        if not first and out:
            first = time.perf_counter()
    rate = (len(out) - 1) / (time.perf_counter() - first)
    stats = sched.stats()
    drafts, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    return out, rate, steps, drafts, accepted


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--workloads", default="", help="comma-separated (default: all)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepare_model(None)))
    runners = {mode: ModelRunner(WorkerConfig(dtype="float32", kv_cache_memory=128 << 20,
                                              max_model_len=2048, speculative=mode))
               for mode in ("off", "ngram")}  # fmt: skip
    for name, (text, constraint) in _prompts().items():
        if args.workloads and name not in args.workloads.split(","):
            continue
        prompt = tok(text)["input_ids"]
        rates: dict[str, list[float]] = {"off": [], "ngram": []}
        texts = set()
        for i in range(args.rounds):
            for mode in ("off", "ngram") if i % 2 == 0 else ("ngram", "off"):
                out, rate, steps, drafts, accepted = _run(runners[mode], prompt, args, f"{i}",
                                                             constraint)  # fmt: skip
                rates[mode].append(rate)
                texts.add(tuple(out))
                print(f"{name:8s} {mode:5s} round {i}: {rate:6.1f} tok/s, {steps} steps, "
                      f"{drafts} drafts, {accepted} accepted", flush=True)  # fmt: skip
        ratios = [s / o for s, o in zip(rates["ngram"], rates["off"], strict=True)]
        print(f"{name}: ngram / off per round {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"same text: {len(texts) == 1}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
