"""What constrained decoding costs the worker, in process: the step time of a batch of 32
constrained requests against 32 unconstrained ones of the same lengths, how long sampling
waits for the masks after the forward, and the schema set's compile times (cold, and the
cache hit on a repeat).

Per model (the real SmolLM2 in fp32, and the tiny random model whose millisecond steps would
show a stall the real model's hide): the 32 requests take the schemas of
bench/structured_schemas.py in turn, greedy, each ending where its grammar does (EOS); the
unconstrained twins get the same prompts and exactly those output lengths (EOS ignored), so
both runs make the same steps with the same batches. Rounds alternate which run goes first;
the figure is the ratio of the runs' total decode-step times, and the median of the per-step
ratios. Run it alone on the machine (an exclusive lock: figures are ratios within one command).

    PYTHONPATH=. .venv/bin/python bench/structured_bench.py [--rounds 3] [--models real,tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.structured_schemas import CASES, MAX_TOKENS
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.constraints import GrammarCache, load_tokenizer
from shared.model_files import prepare_model
from shared.protocol.sampling import Constraint, SamplingParams
from tests.support.plan_driver import PlanDriver
from tests.support.tiny_model import write_tiny_model

NUM_REQUESTS = 32


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def constraint(i: int) -> Constraint:
    return Constraint("json_schema", json.dumps(CASES[i % len(CASES)].schema))


def prompts(folder: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tok.encode(f"{CASES[i % len(CASES)].prompt} Answer in JSON:").ids
            for i in range(NUM_REQUESTS)]  # fmt: skip


def run(runner: ModelRunner, prompt_ids: list[list[int]], params: list[SamplingParams],
        eos: int) -> tuple[list[int], list[float]]:  # fmt: skip
    """Step the batch to the end; (output lengths, decode-only step times in seconds)."""
    driver = PlanDriver(runner.execute, runner.kv_cache.num_blocks, runner.kv_cache.block_size,
                        chunk_size=512)  # fmt: skip
    for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True)):
        driver.add(f"r{i}", ids, p)
    times: list[float] = []
    while driver.active():
        decoding = all(s.num_computed >= s.num_prompt_tokens for s in driver.seqs.values()
                       if not s.done)  # fmt: skip
        start = time.perf_counter()
        driver.step()
        if decoding:
            times.append(time.perf_counter() - start)
        for seq in driver.seqs.values():  # a constrained reply ends at its EOS
            if (
                not seq.done
                and seq.outputs
                and seq.outputs[-1] == eos
                and not seq.sampling.ignore_eos
            ):
                seq.sampling = replace(seq.sampling, max_tokens=len(seq.outputs))
    return [len(driver.seqs[f"r{i}"].outputs) for i in range(len(params))], times


def cost(folder: Path, rounds: int) -> dict[str, Any]:
    runner = ModelRunner(WorkerConfig(model=str(folder), dtype="float32",
                                      kv_cache_memory=512 << 20))  # fmt: skip
    eos = runner.eos_token_ids[0]
    ids = prompts(folder)
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, constraint=constraint(i))
                   for i in range(NUM_REQUESTS)]  # fmt: skip
    lengths, _ = run(runner, ids, constrained, eos)  # warm-up: compiles, fixes the lengths
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    assert runner.constraints is not None
    runner.constraints.mask_wait_s.clear()
    c_times: list[float] = []
    u_times: list[float] = []
    per_step: list[float] = []
    for r in range(rounds):
        order = (
            [("c", constrained), ("u", plain)] if r % 2 == 0 else [("u", plain), ("c", constrained)]
        )
        got: dict[str, list[float]] = {}
        for name, params in order:
            got_lengths, got[name] = run(runner, ids, params, eos)
            assert got_lengths == lengths, (name, got_lengths, lengths)
        c_times += got["c"]
        u_times += got["u"]
        per_step += [c / u for c, u in zip(got["c"], got["u"], strict=True)]
    waits = list(runner.constraints.mask_wait_s)
    return {
        "model": folder.name, "num_requests": NUM_REQUESTS, "output_tokens": sum(lengths),
        "decode_steps_per_run": len(c_times) // rounds, "rounds": rounds,
        "step_ms_constrained": round(1e3 * statistics.fmean(c_times), 2),
        "step_ms_unconstrained": round(1e3 * statistics.fmean(u_times), 2),
        "ratio_total": round(sum(c_times) / sum(u_times), 4),
        "ratio_median_step": round(statistics.median(per_step), 4),
        "mask_wait_p50_ms": round(1e3 * pct(waits, 0.5), 3),
        "mask_wait_p99_ms": round(1e3 * pct(waits, 0.99), 3),
    }  # fmt: skip


def compile_times(folder: Path) -> dict[str, Any]:
    """The schema set through the frontend's cache: cold compiles, then the repeat (hits)."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    cache = GrammarCache(load_tokenizer(folder, vocab, [2]))
    cold, warm = [], []
    for out in (cold, warm):
        for i in range(len(CASES)):
            start = time.perf_counter()
            assert cache.check(constraint(i)) is None
            out.append(time.perf_counter() - start)
    return {"num_schemas": len(CASES), "compile_p50_ms": round(1e3 * pct(cold, 0.5), 3),
            "compile_max_ms": round(1e3 * max(cold), 3),
            "repeat_p50_ms": round(1e3 * pct(warm, 0.5), 4), "cache_hits": cache.num_hits,
            "compiles": cache.num_compiles}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="real,tiny")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")  # fmt: skip
    print(json.dumps({"cpu": cpu, "threads": torch.get_num_threads()}))
    real = prepare_model(None)
    print(json.dumps({"compile": compile_times(real)}))
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"real": real, "tiny": write_tiny_model(Path(tmp) / "tiny")}
        for name in args.models.split(","):
            print(json.dumps({"cost": cost(folders[name], args.rounds)}), flush=True)


if __name__ == "__main__":
    main()
