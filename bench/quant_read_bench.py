"""The one-row linear layers against a bare read of the same bytes (issue 31's reference rate).

The default model's linear layers are timed at one row in the model's own order (every layer's
qkv, o, gate_up, down, then the LM head), so each weight comes from memory as in a decode step
(96 MB a token against a 32 MB L3), and each kind's time is summed over the layers. The
reference: a bare streaming read of the same tensors (a C++ loop OR-ing 64-byte vectors, each of
torch's threads one contiguous part, as the kernel gives each thread its tiles), walked in the
same order. Rounds alternate the two; medians printed, with the kernel's share of the read rate.

    PYTHONPATH=. python bench/quant_read_bench.py [--rounds 7] [--steps 20] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.cpp_extension import load_inline

from services.worker.config import WorkerConfig
from services.worker.linear import BlockLinear
from services.worker.runner import ModelRunner

READ_SRC = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <cstring>
// Every byte of t read once, 64 bytes at a time, the chunks split over torch's threads; the
// OR of all words returned so the loads cannot be dropped.
int64_t stream_read(const at::Tensor& t) {
  const auto* p = reinterpret_cast<const uint64_t*>(t.data_ptr());
  const int64_t words = t.numel() * t.element_size() / 8;
  const int64_t chunks = words / 8;
  std::vector<uint64_t> acc(at::get_num_threads() * 8, 0);
  at::parallel_for(0, chunks, 2048, [&](int64_t b, int64_t e) {
    typedef uint64_t v8 __attribute__((vector_size(64)));
    v8 a{};
    for (int64_t i = b; i < e; ++i) {
      v8 v;
      std::memcpy(&v, p + i * 8, 64);
      a |= v;
    }
    uint64_t s = 0;
    for (int j = 0; j < 8; ++j) s |= a[j];
    acc[at::get_thread_num() * 8] |= s;
  });
  uint64_t s = 0;
  for (uint64_t v : acc) s |= v;
  return static_cast<int64_t>(s & 1);
}
"""

KINDS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


def build_reader() -> Callable[[torch.Tensor], int]:
    mod = load_inline(
        "conveyor_stream_read",
        READ_SRC,
        functions=["stream_read"],
        extra_cflags=["-O3", "-march=native"],
        verbose=False,
    )
    return mod.stream_read


def model_linears(runner: ModelRunner) -> list[tuple[str, BlockLinear]]:
    out = []
    for layer in runner.model.layers:
        out += [(k, getattr(layer, k)) for k in KINDS[:4]]
    out.append(("lm_head", runner.model.lm_head))
    return [(k, lin) for k, lin in out if isinstance(lin, BlockLinear)]


def walk(
    linears: list[tuple[str, BlockLinear]], step: Callable[[BlockLinear], object], steps: int
) -> dict[str, float]:
    """Seconds per walk spent on each kind: summed over the layers, averaged over `steps` walks."""
    spent = dict.fromkeys(KINDS, 0.0)
    for _ in range(steps):
        for kind, lin in linears:
            t0 = time.perf_counter()
            step(lin)
            spent[kind] += time.perf_counter() - t0
    return {k: v / steps for k, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    read = build_reader()
    runner = ModelRunner(WorkerConfig(kv_cache_memory=1 << 29))  # the defaults: auto, auto
    linears = model_linears(runner)
    xs = {lin.packed.qs.data_ptr(): torch.randn(args.rows, lin.packed.k) for _, lin in linears}
    nbytes = dict.fromkeys(KINDS, 0)
    for kind, lin in linears:
        nbytes[kind] += sum(t.numel() * t.element_size() for t in lin.tensors())

    def kernel(lin: BlockLinear) -> object:
        return lin(xs[lin.packed.qs.data_ptr()])

    def bare(lin: BlockLinear) -> object:
        return [read(t) for t in lin.tensors()]

    runs: dict[str, list[dict[str, float]]] = {"kernel": [], "read": []}
    for _ in range(args.rounds):
        for name, fn in (("kernel", kernel), ("read", bare)):
            walk(linears, fn, 1)  # warm
            runs[name].append(walk(linears, fn, args.steps))
    print(
        f"{args.rows} row(s), threads={torch.get_num_threads()}, median of {args.rounds} "
        f"rounds x {args.steps} walks; kernel ms / GB/s, bare read ms / GB/s, kernel / read rate"
    )
    for kind in KINDS + ("all",):
        k = _median(runs["kernel"], kind)
        r = _median(runs["read"], kind)
        b = sum(nbytes.values()) if kind == "all" else nbytes[kind]
        print(
            f"  {kind:<8} {b / 1e6:6.1f} MB  kernel {k * 1e3:6.2f} ms {b / k / 1e9:5.1f} GB/s"
            f"  read {r * 1e3:6.2f} ms {b / r / 1e9:5.1f} GB/s  {r / k:5.1%}"
        )


def _median(runs: list[dict[str, float]], kind: str) -> float:
    vals = [sum(r.values()) if kind == "all" else r[kind] for r in runs]
    return statistics.median(vals)


if __name__ == "__main__":
    main()
