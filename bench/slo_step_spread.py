"""How much the real worker's same-shape decode steps vary with nothing else running: the noise
floor under the step-time predictor's error on the real model (issue 33,
docs/lab/2026-12-slo-drift.md), without the scheduler, gateway, tokenizer or client that share
the cores in a serving run.

Times `--steps` consecutive identical decode steps (bench/worker_step_bench.py's case: every
sequence at `context` cached tokens) at each batch size, and prints their spread: p10-p90, the
error of predicting each step by the median of the 8 either side (as the lab note's local
oracle does from a step log, the step itself left out), adjacent steps' |t2 / t1 - 1|, and the
medians of 30-step blocks (a drift shows there).

    PYTHONPATH=. .venv/bin/python bench/slo_step_spread.py [--batches 6,16] [--context 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.worker_step_bench import ours_decode
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner

NEIGHBOURS = 8
BLOCK = 30


def spread(times: np.ndarray) -> str:
    """One line of the spread figures of consecutive same-shape step times (seconds)."""
    p10, p50, p90 = np.quantile(times, [0.1, 0.5, 0.9]) * 1e3
    local = []
    for i, t in enumerate(times):
        near = np.delete(times[max(0, i - NEIGHBOURS) : i + NEIGHBOURS + 1], min(i, NEIGHBOURS))
        local.append(abs(float(np.median(near)) - t) / t)
    adjacent = np.abs(times[1:] / times[:-1] - 1)
    blocks = np.median(times[: len(times) // BLOCK * BLOCK].reshape(-1, BLOCK), axis=1) * 1e3
    return (
        f"median {p50:.2f} ms, p10-p90 {p10:.2f}-{p90:.2f} ms; local-median error p50 / p90 "
        f"{np.quantile(local, 0.5) * 100:.1f} / {np.quantile(local, 0.9) * 100:.1f}%; adjacent "
        f"|t2/t1-1| p90 {np.quantile(adjacent, 0.9) * 100:.1f}%; {BLOCK}-step medians "
        f"{blocks.min():.1f}-{blocks.max():.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="6,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    runner = ModelRunner(WorkerConfig(dtype=args.dtype, kv_cache_memory=1 << 30))
    for n, batch in enumerate(int(b) for b in args.batches.split(",")):
        step = ours_decode(runner, batch, args.context, 1000 * (n + 1))
        for _ in range(5):  # warm-up
            step()
        times = []
        for _ in range(args.steps):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        print(f"decode B={batch}, {args.context} cached: {spread(np.array(times))}", flush=True)


if __name__ == "__main__":
    main()
