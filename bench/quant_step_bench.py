"""The worker step per weights / KV setting, beside transformers, and its linear layers' share.

Decode steps at batch 1, 8, 32, 128 (~256 cached tokens each) and one 512-token prefill, each
timed for every setting (QUANTIZATION[/DTYPE[/KV_CACHE_DTYPE]], as bench/quant_quality.py) and
for transformers in fp32, all in this one process on the same machine state (minimum of
`--repeat`). Then, per setting, the step's linear layers alone (every layer's projections and
the LM head at the step's rows, through the setting's own kernels) and their rate against the
bare kernel on the same shapes outside the step (`linear GFLOP/s`): the step's linear time over
its step time is the linear share.

    PYTHONPATH=. python bench/quant_step_bench.py [--settings none/float32,auto,auto//bfloat16,int8]
        [--batches 1,8,32,128] [--context 256] [--prefill 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.quant_quality import setting_config
from bench.worker_step_bench import hf_decode, hf_prefill, ours_decode, ours_prefill, timed
from services.worker.dtype_probe import linear_shapes
from services.worker.runner import ModelRunner


def sized(setting: str, batches: list[int], context: int, prefill: int) -> ModelRunner:
    """The setting's runner with a KV pool just large enough for the largest batch."""
    config = setting_config(setting, max(context + 32, prefill))
    probe_bytes = 64 << 20  # holds one sequence of max_model_len in any KV dtype
    probe = ModelRunner(config.__class__(**{**_fields(config), "kv_cache_memory": probe_bytes}))
    per_token = probe.kv_cache.num_bytes / (probe.kv_cache.num_blocks * probe.kv_cache.block_size)
    del probe
    need = max(int((max(batches) + 1) * (context + 32) * per_token), probe_bytes)
    return ModelRunner(config.__class__(**{**_fields(config), "kv_cache_memory": need}))


def _fields(config: object) -> dict:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}  # type: ignore[attr-defined]


def linear_seconds(runner: ModelRunner, rows: int, head_rows: int, repeat: int) -> float:
    """Every layer's projections at `rows` rows plus the LM head at `head_rows`, through the
    runner's own Linear objects (its kernels, its weights), minimum of `repeat`."""
    model = runner.model
    x = {k: torch.randn(rows, k).to(runner.dtype) for k, _ in linear_shapes(runner.args)}
    head_x = torch.randn(head_rows, runner.args.hidden_size).to(runner.dtype)
    inter = runner.args.intermediate_size

    def run() -> None:
        with torch.inference_mode():
            for layer in model.layers:
                layer.qkv(x[runner.args.hidden_size])
                layer.o_proj(x[runner.args.num_heads * runner.args.head_dim])
                layer.gate_up(x[runner.args.hidden_size])
                layer.down(x[inter])
            model.lm_head(head_x)

    return min(timed(run, repeat))


def step_flops(runner: ModelRunner, rows: int, head_rows: int) -> float:
    a = runner.args
    per_layer = sum(2.0 * rows * k * n for k, n in linear_shapes(a))
    return a.num_layers * per_layer + 2.0 * head_rows * a.hidden_size * a.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="none/float32,auto,auto//bfloat16,int8")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    settings = args.settings.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runners = {s: sized(s, batches, args.context, args.prefill) for s in settings}
    from transformers import LlamaForCausalLM

    folder = next(iter(runners.values())).folder
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cases: list[tuple[str, int, Callable[[ModelRunner, int], Callable], Callable]] = [
        (f"decode B={b}", b, lambda r, i, b=b: ours_decode(r, b, args.context, i),
         lambda b=b: hf_decode(hf, b, args.context, torch.float32))
        for b in batches
    ]  # fmt: skip
    cases.append((f"prefill {args.prefill}", args.prefill,
                  lambda r, i: ours_prefill(r, args.prefill),
                  lambda: hf_prefill(hf, args.prefill)))  # fmt: skip
    print(f"| step | {' | '.join(settings)} | transformers fp32 |")
    print("|---|" + "---:|" * (len(settings) + 1))
    shares: dict[str, list[str]] = {s: [] for s in settings}
    for i, (name, rows, make_ours, make_hf) in enumerate(cases):
        cells = []
        head_rows = rows if name.startswith("decode") else 1
        for s, runner in runners.items():
            t = min(timed(make_ours(runner, i + 1), args.repeat))
            lin = linear_seconds(runner, rows, head_rows, args.repeat)
            gflops = step_flops(runner, rows, head_rows) / lin / 1e9
            shares[s].append(f"{name}: linear {100 * lin / t:.0f}% at {gflops:.0f} GFLOP/s")
            cells.append(f"{t * 1e3:.1f}")
        t_hf = min(timed(make_hf(), args.repeat))
        print(f"| {name} | {' | '.join(cells)} | {t_hf * 1e3:.1f} |", flush=True)
    for s in settings:
        r = runners[s]
        print(f"\n{s} ({r.quantization}, {r.dtype_name}, KV {r.kv_cache.dtype_name}): "
              + "; ".join(shares[s]))  # fmt: skip
    print(f"\nthreads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
