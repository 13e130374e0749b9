"""The one-row decode step with and without each of its small-op optimisations, same process.

Each variant swaps one piece of the worker's CPU path for what it replaced; the step (the
runner's `execute`: inputs, forward, sampling) is timed in interleaved rounds, so the machine's
drift hits every variant alike, and the median round is printed with its ratio to `current`.

* `current`: the worker as it runs (with packed block weights: each layer one C++ call,
  kernels/csrc/decoder_layer.cpp).
* `python_layers`: each layer as the model's Python sequence of ops calls (rotary + KV write
  one C++ call on the fused qkv).
* `split_kv_write`: Python layers, and rotary as its own C++ call, then the KV write as torch's
  two `index_copy_` on q/k/v views (the path before kernels/csrc/kv_write.cpp).

    PYTHONPATH=. python bench/decode_path_bench.py [--batch 1] [--context 64] [--steps 50]
        [--rounds 7] [--variants current,python_layers,split_kv_write]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.worker_step_bench import ours_decode
from services.worker.config import WorkerConfig
from services.worker.ops import TorchOps, rotary_then_write
from services.worker.runner import ModelRunner


class SplitKVWrite:
    """The ops as they were: rotary (the ops' own), then TorchOps' index_copy_ KV write."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self._torch = TorchOps()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def write_kv(self, *args: Any) -> None:
        self._torch.write_kv(*args)

    def rotary_write_kv(self, *args: Any) -> torch.Tensor:
        return rotary_then_write(self, *args)


# name -> (the ops it runs with, whether whole-layer kernels may run)
VARIANTS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    "current": (lambda ops: ops, True),
    "python_layers": (lambda ops: ops, False),
    "split_kv_write": (SplitKVWrite, False),
}


def timed(run: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = args.variants.split(",")
    runner = ModelRunner(WorkerConfig(kv_cache_memory=1 << 29))  # the defaults: auto, auto
    model = runner.model
    base_ops, base_native = model.ops, model.native
    run = ours_decode(runner, args.batch, args.context, 0)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            wrap, native = VARIANTS[name]
            model.ops = wrap(base_ops)
            model.use_native_layers(native)
            run()  # warm
            times[name].append(timed(run, args.steps))
    model.ops = base_ops
    model.use_native_layers(True)
    print(
        f"decode step, batch {args.batch}, context {args.context}: {runner.quantization} "
        f"{runner.dtype_name}, ops={base_ops.name}, whole-layer kernels {base_native}, "
        f"threads={torch.get_num_threads()}, "
        f"median of {args.rounds} rounds x {args.steps} steps"
    )
    ref = statistics.median(times[names[0]])
    for name in names:
        med = statistics.median(times[name])
        spread = f"{min(times[name]) * 1e3:.2f}-{max(times[name]) * 1e3:.2f}"
        print(f"  {name:<16} {med * 1e3:7.2f} ms  (rounds {spread})  {med / ref:.3f}x {names[0]}")


if __name__ == "__main__":
    main()
