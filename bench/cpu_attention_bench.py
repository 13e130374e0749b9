"""One layer's paged attention on the CPU: the C++ kernel against the torch paths, side by side.

SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, block 16). Per case, best of
`--repeat` calls of: the C++ extension (kernels/csrc/paged_attention.cpp), the worker's torch
path (TorchOps.paged_attention: block gather + SDPA with a mask) and, for the fresh prefill,
torch's causal SDPA over contiguous q/k/v with no paging at all (the fastest torch can do).
Then decode at 2,048 cached tokens (B=1 and B=32) through the C++ kernel with the cache stored
in each `--kv-cache-dtype` (fp32 q and output): the fp32 cache's time over each compact one's.
Run it alone on the machine and quote ratios from one run:

    PYTHONPATH=. .venv/bin/python bench/cpu_attention_bench.py --repeat 10
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.kernel_inputs import make_paged_batch
from kernels.cpu_ext import cpu_paged_attention, load_cpu_ops
from kernels.kv_quant import CODE_DTYPES, quantize_rows
from services.worker.ops import TorchOps
from services.worker.ops_cpu import ext_cache_dir

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# name -> (new tokens per sequence, cached tokens per sequence)
CASES: dict[str, tuple[list[int], list[int]]] = {
    "decode B=1 (256 cached)": ([1], [256]),
    "decode B=32 (256 cached)": ([1] * 32, [256] * 32),
    "decode B=128 (256 cached)": ([1] * 128, [256] * 128),
    "prefill 512": ([512], [0]),
    "chunk 512 on 512 cached": ([512], [512]),
    "mixed: chunk 256 + 31 decodes": ([256] + [1] * 31, [0] + [256] * 31),
}


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up (first-touch of buffers, thread pool)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def causal_sdpa(batch, scale: float) -> Callable[[], object]:
    """torch's own causal SDPA on one fresh sequence, q/k/v contiguous [1, H, T, D] (GQA
    expanded beforehand, outside the timed call): no block table, no mask tensor."""
    t = batch.q.shape[0]
    q = batch.q.transpose(0, 1).unsqueeze(0).contiguous()
    k = torch.randn(1, HEADS, t, HEAD_DIM).to(batch.q.dtype)
    v = torch.randn(1, HEADS, t, HEAD_DIM).to(batch.q.dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3")
LONG_CONTEXT = 2048


def stored(cache: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """An fp32 cache [N, bs, Hkv, D] as the KV pool of `kv_dtype` holds it."""
    if kv_dtype in CODE_DTYPES:
        return quantize_rows(cache, kv_dtype)
    return cache.to(getattr(torch, kv_dtype))


def compact_kv_table(ext, scale: float, repeat: int, gen: torch.Generator) -> None:
    print(
        f"\n| decode, {LONG_CONTEXT} cached | " + " | ".join(KV_DTYPES) + " (ms) | fp32 / compact |"
    )
    print("|---|" + "---:|" * (len(KV_DTYPES) + 1))
    for batch_size in (1, 32):
        batch = make_paged_batch(
            [1] * batch_size, [LONG_CONTEXT] * batch_size, num_kv_heads=KV_HEADS,
            group=HEADS // KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
            dtype=torch.float32, generator=gen,
        )  # fmt: skip
        q, k, v, *meta = batch.attention_args()
        ms = {}
        for kv in KV_DTYPES:
            args = (q, stored(k, kv), stored(v, kv), *meta)
            ms[kv] = best_ms(lambda a=args: cpu_paged_attention(ext, *a, scale), repeat)
        ratios = ", ".join(f"{ms['float32'] / ms[kv]:.2f}" for kv in KV_DTYPES[1:])
        cells = " | ".join(f"{ms[kv]:.3f}" for kv in KV_DTYPES)
        print(f"| B={batch_size} | {cells} | {ratios} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ext = load_cpu_ops(ext_cache_dir())
    torch_ops = TorchOps()
    scale = 1.0 / math.sqrt(HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    print(f"dtype {args.dtype}, {torch.get_num_threads()} threads, best of {args.repeat}")
    print("| case | C++ (ms) | torch path (ms) | causal SDPA (ms) | torch path / C++ |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, (q_lens, ctx_lens) in CASES.items():
            batch = make_paged_batch(
                q_lens, ctx_lens, num_kv_heads=KV_HEADS, group=HEADS // KV_HEADS,
                head_dim=HEAD_DIM, block_size=BLOCK, dtype=dtype, generator=gen,
            )  # fmt: skip
            attn = batch.attention_args()
            ours = best_ms(lambda a=attn: cpu_paged_attention(ext, *a, scale), args.repeat)
            ref = best_ms(lambda a=attn: torch_ops.paged_attention(*a, scale), args.repeat)
            fresh = len(q_lens) == 1 and ctx_lens[0] == 0
            sdpa = f"{best_ms(causal_sdpa(batch, scale), args.repeat):.3f}" if fresh else "-"
            print(f"| {name} | {ours:.3f} | {ref:.3f} | {sdpa} | {ref / ours:.2f} |")
        if dtype == torch.float32:
            compact_kv_table(ext, scale, args.repeat, gen)


if __name__ == "__main__":
    main()
