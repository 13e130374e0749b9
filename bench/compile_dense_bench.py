"""Does torch.compile (inductor, frozen weights) of the per-layer dense part pay on this CPU?

The dense part of one layer is everything but attention: before it, residual-add + RMSNorm and
the fused qkv projection; after it, o_proj, residual-add + RMSNorm, gate/up, SiLU-and-mul and
down. This times that part for all of the model's layers (their own weights, so they stream from
memory as in a real step) at `--rows` rows (32: a B=32 decode step), three ways in one process:

* eager, as the worker runs it on CPU (F.linear + the C++ extension's rms_norm/silu_and_mul);
* inductor with the weights as graph inputs (one compiled graph per half, reused by every layer);
* inductor with `freezing` (each layer a module whose weights are constants: inductor may
  pre-pack them for oneDNN and fold them into the graph; one compile per layer and half).

Compiling is CPU-heavy but not timed: with `--lock PATH` the script compiles under a shared
flock on PATH and times under an exclusive one (the team's benchmark protocol), so run it
without an outer flock in that case.

    PYTHONPATH=. python bench/compile_dense_bench.py [--rows 32] [--repeat 10]
        [--layers N] [--lock /tmp/conveyor-cpu.lock]
"""

from __future__ import annotations

import argparse
import fcntl
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F

from bench.cpu_attention_bench import best_ms
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner


class Pre(torch.nn.Module):
    """residual-add + RMSNorm + fused qkv, in plain torch (what inductor sees)."""

    def __init__(self, norm: torch.Tensor, qkv: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(norm, requires_grad=False)  # [Hd]
        self.qkv = torch.nn.Parameter(qkv, requires_grad=False)  # [(H + 2 Hkv) D, Hd]
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pre(x, residual, self.norm, self.qkv, self.eps)


class Post(torch.nn.Module):
    """o_proj, residual-add + RMSNorm, gate/up, SiLU-and-mul, down, in plain torch."""

    def __init__(self, layer: Any, eps: float) -> None:
        super().__init__()
        for name in ("o_proj", "post_norm", "gate_up", "down"):
            setattr(self, name, torch.nn.Parameter(getattr(layer, name), requires_grad=False))
        self.eps = eps

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return post(attn, residual, self.o_proj, self.post_norm, self.gate_up, self.down, self.eps)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def pre(x, residual, norm, qkv, eps: float) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    r = x + residual
    return F.linear(rms(r, norm, eps), qkv), r


def post(attn, residual, o_proj, norm, gate_up, down, eps: float) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    r = F.linear(attn, o_proj) + residual
    g, u = F.linear(rms(r, norm, eps), gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down), r


def lock(fd: Optional[int], mode: int) -> None:
    if fd is not None:
        fcntl.flock(fd, mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--layers", type=int, default=None, help="the first N layers (default all)")
    ap.add_argument("--lock", default=None, help="flock file: shared to compile, exclusive to time")
    args = ap.parse_args()
    lock_file = open(args.lock, "a") if args.lock else None  # noqa: SIM115 (held to exit)
    fd = lock_file.fileno() if lock_file is not None else None
    lock(fd, fcntl.LOCK_SH)
    runner = ModelRunner(
        WorkerConfig(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024)
    )
    model, ops, eps = runner.model, runner.model.ops, runner.args.rms_norm_eps
    model.layers = model.layers[: args.layers]
    hd, q = runner.args.hidden_size, runner.args.num_heads * runner.args.head_dim
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.rows, hd, generator=gen)
    attn = torch.randn(args.rows, q, generator=gen)  # stands in for attention's output

    def eager() -> None:
        x, res = x0, torch.zeros_like(x0)
        for layer in model.layers:
            h, res = ops.rms_norm(x, layer.input_norm, eps, res)
            F.linear(h, layer.qkv)
            x = F.linear(attn, layer.o_proj)
            h, res = ops.rms_norm(x, layer.post_norm, eps, res)
            x = F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up)), layer.down)

    def run_halves(pre_fns: list, post_fns: list, weights: bool) -> Callable[[], None]:
        def run() -> None:
            x, res = x0, torch.zeros_like(x0)
            for i, layer in enumerate(model.layers):
                if weights:
                    _, res = pre_fns[0](x, res, layer.input_norm, layer.qkv, eps)
                    x, res = post_fns[0](
                        attn, res, layer.o_proj, layer.post_norm, layer.gate_up, layer.down, eps
                    )
                else:
                    _, res = pre_fns[i](x, res)
                    x, res = post_fns[i](attn, res)

        return run

    torch._dynamo.config.cache_size_limit = 4 * len(model.layers)
    torch._dynamo.config.accumulated_cache_size_limit = 8 * len(model.layers)
    with torch.inference_mode():
        start = time.perf_counter()
        as_inputs = run_halves([torch.compile(pre)], [torch.compile(post)], weights=True)
        as_inputs()
        t_inputs = time.perf_counter() - start
        torch._inductor.config.freezing = True
        start = time.perf_counter()
        frozen = run_halves(
            [torch.compile(Pre(la.input_norm, la.qkv, eps)) for la in model.layers],
            [torch.compile(Post(la, eps)) for la in model.layers],
            weights=False,
        )
        frozen()
        t_frozen = time.perf_counter() - start
        lock(fd, fcntl.LOCK_EX)
        times = {
            "eager (C++ ops)": best_ms(eager, args.repeat) / 1e3,
            "inductor, weights as inputs": best_ms(as_inputs, args.repeat) / 1e3,
            "inductor, frozen weights": best_ms(frozen, args.repeat) / 1e3,
            "eager (C++ ops), again": best_ms(eager, args.repeat) / 1e3,
        }
    print(f"threads={torch.get_num_threads()} rows={args.rows} layers={len(model.layers)}")
    print(f"compile time: weights as inputs {t_inputs:.1f} s, frozen {t_frozen:.1f} s")
    base = times["eager (C++ ops)"]
    print(f"| dense part of all layers, {args.rows} rows, fp32 | ms | eager / this |")
    print("|---|---:|---:|")
    for name, s in times.items():
        print(f"| {name} | {s * 1e3:.1f} | {base / s:.2f} |")


if __name__ == "__main__":
    main()
