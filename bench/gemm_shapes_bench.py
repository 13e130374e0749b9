"""Fused or separate projections: which runs faster through torch's CPU GEMM at decode sizes?

The worker fuses q/k/v into one [(H + 2 Hkv) D, Hd] matrix and gate/up into one [2 I, Hd];
transformers runs them as separate linears. This times one step's worth of each (all layers,
each layer its own weights so they stream from memory as in a real step, and once more with one
layer's weights reused, cache-hot, as a bare GEMM loop does) at `--rows` rows, fp32, in one
process, best of `--repeat`.

    PYTHONPATH=. python bench/gemm_shapes_bench.py [--rows 32,128] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30

GROUPS = {  # name -> the (out features) of the linears that compute it, all from HIDDEN
    "qkv fused": [(HEADS + 2 * KV_HEADS) * HEAD_DIM],
    "q, k, v separate": [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM],
    "gate_up fused": [2 * INTER],
    "gate, up separate": [INTER, INTER],
}


def step_ms(x: torch.Tensor, weights: list[list[torch.Tensor]], repeat: int) -> float:
    """Best time of one pass over every layer's weights (each layer: one F.linear per matrix)."""
    best = float("inf")
    for _ in range(repeat + 1):
        start = time.perf_counter()
        for layer in weights:
            for w in layer:
                F.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,128")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"threads={torch.get_num_threads()}, fp32, {LAYERS} layers, best of {args.repeat}")
    print("| linears | rows | streaming weights (ms/step) | one layer's weights, hot (ms/step) |")
    print("|---|---:|---:|---:|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, HIDDEN, generator=gen)
            for name, outs in GROUPS.items():
                streaming = [
                    [torch.randn(n, HIDDEN, generator=gen) for n in outs] for _ in range(LAYERS)
                ]
                hot = [streaming[0]] * LAYERS
                cold_ms = step_ms(x, streaming, args.repeat)
                hot_ms = step_ms(x, hot, args.repeat)
                print(f"| {name} | {rows} | {cold_ms:.1f} | {hot_ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
