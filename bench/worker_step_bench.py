"""Time one worker step against transformers' forward with its contiguous cache.

Decode: one step at batch 1, 8, 32, 128 with ~256 cached tokens per sequence; prefill: one
512-token prompt. Three paths run in this one process on the same weights and dtype, so the
ratios are fair even on a shared machine (take the minimum of several repeats): the worker with
its default CPU ops (the C++ extension), the same worker with the plain-torch ops (the old path:
gathered, padded SDPA), and transformers. The KV contents are random: step time does not depend
on them.

    PYTHONPATH=. python bench/worker_step_bench.py [--dtype auto] [--batches 1,8,32,128]
        [--context 256] [--prefill 512] [--repeat 5] [--threads 2] [--out results/...json]

Writes JSON to results/ and prints a markdown table of times and ratios (transformers / ours:
above 1 means the paged step is faster) for docs/PERFORMANCE.md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.worker.config import WorkerConfig
from services.worker.ops import TorchOps
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence

GREEDY = SamplingParams(temperature=0.0)


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def decoding_sequences(
    writer: PlanWriter, rids: list[str], context: int, per_seq: int
) -> list[NewSequence]:
    """Sequences that have computed `context` tokens and decode their next one, each in its own
    `per_seq` consecutive blocks (request i in blocks [i * per_seq, (i + 1) * per_seq))."""
    return [
        writer.new_sequence(
            rid,
            [7] * (context + 1),
            context + 1,
            list(range(i * per_seq, (i + 1) * per_seq)),
            GREEDY,
            num_computed_tokens=context,
        )
        for i, rid in enumerate(rids)
    ]


def ours_decode(runner: ModelRunner, batch: int, context: int, step_id: int) -> Callable:
    """A plan whose sequences already hold `context` tokens (their blocks exist; contents are
    whatever the pool holds), then one decode token each."""
    bs = runner.kv_cache.block_size
    per_seq = -(-(context + 1) // bs)
    if per_seq * batch > runner.kv_cache.num_blocks:
        raise ValueError(f"KV pool too small for batch {batch}: raise --kv-cache-memory")
    rids = [f"b{batch}-{i}" for i in range(batch)]
    writer = PlanWriter(first_step_id=step_id)  # a fresh writer: its first plan is a reset
    news = decoding_sequences(writer, rids, context, per_seq)
    runner.held.apply(writer.plan({}, news))  # held, nothing computed yet
    held = list(runner.held.seqs.values())

    def run() -> None:
        runner.execute(writer.plan(dict.fromkeys(rids, 1)))  # the steady decode plan
        for seq in held:  # rewind: every run decodes at `context` again
            seq.num_computed = context
            del seq.token_ids[context + 1 :]

    return run


def ours_prefill(runner: ModelRunner, length: int) -> Callable:
    blocks = list(range(-(-length // runner.kv_cache.block_size)))
    ids = [(i * 31) % 40000 + 10 for i in range(length)]

    def run() -> None:
        writer = PlanWriter()  # a reset plan each time: the prompt alone in the batch
        new = writer.new_sequence("prefill", ids, length, blocks, GREEDY)
        runner.execute(writer.plan({"prefill": length}, [new]))

    return run


def hf_decode(model, batch: int, context: int, dtype: torch.dtype) -> Callable:
    from transformers import DynamicCache

    cfg = model.config
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    ids = torch.full((batch, 1), 7)
    pos = torch.full((batch, 1), context)

    def run() -> None:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-1)  # drop the token just appended: every run sees `context` cached

    return run


def hf_prefill(model, length: int) -> Callable:
    ids = torch.tensor([[(i * 31) % 40000 + 10 for i in range(length)]])

    def run() -> None:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True)

    return run


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/worker_step_bench.json")
    return ap.parse_args()


def load_engines(args: argparse.Namespace, batches: list[int]) -> tuple[ModelRunner, object]:
    """Our worker (KV pool sized for the largest batch) and transformers on the same weights;
    `args.dtype` is resolved from "auto" as the worker does."""
    probe = ModelRunner(
        WorkerConfig(dtype=args.dtype, kv_cache_memory=64 << 20, max_model_len=1024)
    )
    args.dtype = probe.dtype_name
    del probe
    dtype = getattr(torch, args.dtype)
    need = max(batches) * (args.context + 16) * 2 * 30 * 3 * 64 * dtype.itemsize
    runner = ModelRunner(WorkerConfig(dtype=args.dtype, kv_cache_memory=max(need, 1 << 30)))
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(runner.folder, dtype=dtype).eval()
    return runner, model


Case = tuple[str, Callable[[], Callable], Callable[[], Callable]]


def build_cases(
    args: argparse.Namespace, batches: list[int], runner: ModelRunner, model: object
) -> list[Case]:
    """(name, make ours, make transformers') per case. Each case is built just before it runs:
    building a decode case applies a reset plan to the worker's held batch, which would
    invalidate the cases built before it."""
    dtype = getattr(torch, args.dtype)
    cases: list[Case] = [
        (
            f"decode B={b}",
            lambda b=b, i=i: ours_decode(runner, b, args.context, i),
            lambda b=b: hf_decode(model, b, args.context, dtype),
        )
        for i, b in enumerate(batches)
    ]
    cases.append(
        (
            f"prefill {args.prefill}",
            lambda: ours_prefill(runner, args.prefill),
            lambda: hf_prefill(model, args.prefill),
        )
    )
    return cases


def time_case(case: Case, runner: ModelRunner, torch_ops: TorchOps, repeat: int) -> dict:
    """One case three ways: our worker with its default ops, with the torch ops, transformers."""
    name, make_ours, make_theirs = case
    ours, theirs = make_ours(), make_theirs()
    fast_ops = runner.model.ops
    t_ours = timed(ours, repeat)
    runner.model.ops = torch_ops
    t_old = timed(ours, repeat)
    runner.model.ops = fast_ops
    t_hf = timed(theirs, repeat)
    print(
        f"{name}: ours ({fast_ops.name}) {min(t_ours) * 1e3:.1f} ms, torch ops "
        f"{min(t_old) * 1e3:.1f} ms, transformers {min(t_hf) * 1e3:.1f} ms",
        flush=True,
    )
    return {
        "case": name,
        "ops": fast_ops.name,
        "ours_min_s": min(t_ours),
        "torch_ops_min_s": min(t_old),
        "hf_min_s": min(t_hf),
        "ours_median_s": statistics.median(t_ours),
        "torch_ops_median_s": statistics.median(t_old),
        "hf_median_s": statistics.median(t_hf),
        "hf_over_ours": min(t_hf) / min(t_ours),
        "torch_ops_over_ours": min(t_old) / min(t_ours),
    }


def print_table(args: argparse.Namespace, ops_name: str, rows: list[dict]) -> None:
    print(
        f"\n| step ({args.dtype}, {args.context} cached) | ours, {ops_name} ops (ms) "
        "| ours, torch ops (ms) | transformers (ms) | transformers / ours | torch ops / ours |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['ours_min_s'] * 1e3:.1f} | {r['torch_ops_min_s'] * 1e3:.1f} "
            f"| {r['hf_min_s'] * 1e3:.1f} | {r['hf_over_ours']:.2f} "
            f"| {r['torch_ops_over_ours']:.2f} |"
        )


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    runner, model = load_engines(args, batches)
    torch_ops = TorchOps()
    cases = build_cases(args, batches, runner, model)
    rows = [time_case(case, runner, torch_ops, args.repeat) for case in cases]
    report = {
        "dtype": args.dtype,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_table(args, runner.model.ops.name, rows)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
