"""Where a worker decode step's time goes, and whether its linear layers run at the GEMM rate.

Profiles `--steps` decode steps at batch `--batch` (`--context` cached tokens each; with
`--chunk N` each step also prefills a fresh N-token prompt, as the mixed steps of a burst do) with
torch.profiler and prints the top operators by self CPU time; then times the same linear-layer
shapes (the fused qkv, o, gate/up and down of one layer, and the LM head at the sampled rows) in
a bare F.linear loop, and prints the step's matmul time against that floor. A ratio near 1 means
the linear layers already run at the machine's GEMM rate (no per-call repacking to fix).

    PYTHONPATH=. python bench/worker_profile.py [--dtype float32] [--batch 32] [--context 256]
        [--ops cpu|torch] [--steps 5] [--chunk 0] [--engine ours|hf]

`--engine hf` profiles transformers' decode step instead (the same DynamicCache set-up as
bench/worker_step_bench.py, same weights and dtype), with the same matmul-vs-bare-GEMM line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.worker_step_bench import GREEDY, decoding_sequences, hf_decode, ours_decode
from services.worker.config import WorkerConfig
from services.worker.dtype_probe import linear_shapes
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul_fused", "mkldnn::_linear")


class LabelledOps:
    """Wraps an ops object so each method shows in the profile as `ops.<name>` (the C++
    extension's calls are not aten operators, so the profiler would not see them otherwise)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, attr: str) -> Any:
        fn = getattr(self.inner, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"ops.{attr}"):
                return fn(*args, **kwargs)

        return call


def ours_mixed(runner: ModelRunner, batch: int, context: int, chunk: int) -> Any:
    """`batch` decodes (as ours_decode) plus the whole `chunk`-token prompt of one more sequence
    in every step; after each step every sequence is rewound (the decodes to `context`
    computed, the prompt to none), so each run computes the same mixed step."""
    bs = runner.kv_cache.block_size
    per_seq = -(-(context + 1) // bs)
    blocks = list(range(batch * per_seq, batch * per_seq + -(-chunk // bs)))
    if blocks[-1] >= runner.kv_cache.num_blocks:
        raise ValueError("KV pool too small: lower --batch, --context or --chunk")
    ids = [(i * 31) % 40000 + 10 for i in range(chunk)]
    rids = [f"b{batch}-{i}" for i in range(batch)]
    writer = PlanWriter()  # its first plan is a reset
    news = decoding_sequences(writer, rids, context, per_seq)
    news.append(writer.new_sequence("chunk", ids, chunk, blocks, GREEDY))
    runner.held.apply(writer.plan({}, news))  # held, nothing computed yet
    held = list(runner.held.seqs.values())
    scheduled = {**dict.fromkeys(rids, 1), "chunk": chunk}

    def run() -> None:
        runner.execute(writer.plan(scheduled))
        for seq in held:  # rewind: every run computes the same step again
            done = 0 if seq.rid == "chunk" else context
            seq.num_computed = done
            del seq.token_ids[max(done + 1, seq.num_prompt_tokens) :]

    return run


def unfused_shapes(args: Any) -> list[tuple[int, int]]:
    """(in, out) features of one layer as transformers runs it: q, k, v, o, gate, up, down."""
    hd, d, inter = args.hidden_size, args.head_dim, args.intermediate_size
    kv = (hd, args.num_kv_heads * d)
    return [
        (hd, args.num_heads * d),
        kv,
        kv,
        (args.num_heads * d, hd),
        (hd, inter),
        (hd, inter),
        (inter, hd),
    ]


def bare_linear_seconds(
    runner: ModelRunner, rows: int, head_rows: int, repeat: int, fused: bool = True
) -> float:
    """One step's linear layers (all layers at `rows` rows + the LM head at `head_rows` sampled
    rows) timed in a bare F.linear loop; `fused`: our fused qkv and gate/up, else HF's shapes."""
    args, dtype = runner.args, runner.dtype
    gen = torch.Generator().manual_seed(0)
    pairs = [
        (torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))
        for k, n in (linear_shapes(args) if fused else unfused_shapes(args))
    ]
    head = (  # the LM head's shape (it may be held as blocks: a dense stand-in here)
        torch.randn(head_rows, args.hidden_size, generator=gen).to(dtype),
        torch.randn(args.vocab_size, args.hidden_size, generator=gen).to(dtype),
    )
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat + 1):
            start = time.perf_counter()
            for _layer in range(args.num_layers):
                for x, w in pairs:
                    torch.nn.functional.linear(x, w)
            torch.nn.functional.linear(*head)
            best = min(best, time.perf_counter() - start)
    return best


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--ops", default="auto", choices=["auto", "cpu", "torch"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=0, help="prefill tokens added to each step")
    ap.add_argument("--engine", default="ours", choices=["ours", "hf"])
    return ap.parse_args()


def make_step(args: argparse.Namespace, runner: ModelRunner) -> Callable[[], None]:
    """The step to profile: ours (decode, or mixed with `--chunk`) or transformers' decode."""
    if args.engine == "hf":
        if args.chunk > 0:
            raise SystemExit("--engine hf profiles decode steps only (no --chunk)")
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(runner.folder, dtype=runner.dtype).eval()
        return hf_decode(hf, args.batch, args.context, runner.dtype)
    if args.chunk > 0:
        return ours_mixed(runner, args.batch, args.context, args.chunk)
    return ours_decode(runner, args.batch, args.context, 0)


def print_summary(
    args: argparse.Namespace, runner: ModelRunner, events: Any, step_s: float
) -> None:
    """Matmuls, each `ops.*` kernel and the rest per step; the matmuls against a bare loop."""
    matmul_s = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6
    matmul_s /= args.steps
    sampled = args.batch + (1 if args.chunk > 0 else 0)
    bare_s = bare_linear_seconds(
        runner, args.batch + args.chunk, sampled, 5, fused=args.engine == "ours"
    )
    num_ops = sum(e.count for e in events) / args.steps
    kernels = {
        e.key: e.cpu_time_total / 1e3 / args.steps for e in events if e.key.startswith("ops.")
    }
    rest_ms = step_s * 1e3 - matmul_s * 1e3 - sum(kernels.values())
    parts = [f"matmuls {matmul_s * 1e3:.1f} ms"]
    parts += [f"{k} {v:.1f} ms" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])]
    parts.append(f"everything else {rest_ms:.1f} ms")
    print("per step: " + ", ".join(parts))
    print(f"step (unprofiled): {step_s * 1e3:.1f} ms; operator calls per step: {num_ops:.0f}")
    print(
        f"matmuls in the step: {matmul_s * 1e3:.1f} ms; the same shapes in a bare F.linear loop: "
        f"{bare_s * 1e3:.1f} ms (ratio {matmul_s / bare_s:.2f}); "
        f"linear share of the step {bare_s / step_s:.0%}"
    )


def main() -> None:
    args = parse_args()
    need = (args.batch * (args.context + 16) + args.chunk + 16) * 2 * 30 * 3 * 64 * 4
    runner = ModelRunner(
        WorkerConfig(
            dtype=args.dtype, kv_cache_memory=max(need, 1 << 29), attention_backend=args.ops
        )
    )
    run = make_step(args, runner)
    run()
    start = time.perf_counter()
    for _ in range(args.steps):
        run()
    step_s = (time.perf_counter() - start) / args.steps
    runner.model.ops = LabelledOps(runner.model.ops)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            run()
    runner.model.ops = runner.model.ops.inner
    events = prof.key_averages()
    engine = "transformers" if args.engine == "hf" else f"ours, ops={runner.model.ops.name}"
    print(f"{engine} dtype={runner.dtype_name} threads={torch.get_num_threads()}")
    print(events.table(sort_by="cpu_time_total", row_limit=20))
    print_summary(args, runner, events, step_s)


if __name__ == "__main__":
    main()
