"""Timed sections of the GPU check: copy bandwidth, decode and prefill attention, engine step.

Each section takes `expired` (the soft deadline) and starts no case after it. Decode attention
is timed twice: eagerly (what one Python launch costs, launch overhead included) and replayed
from a CUDA graph (the kernel alone, what a graph-captured decode step would see); GB/s uses the
graph time when capture works. `dry` selects tiny sizes for a CPU run under the interpreter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from bench.gpu.model import LLAMA_1B, TINY, RandomLlama, make_step
from kernels import paged_attention

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# (label, KV heads, GQA group, head_dim): Llama-3.2-1B and Llama-3.1-8B attention shapes.
SHAPE_1B, SHAPE_8B = ("1B", 8, 4, 64), ("8B", 8, 4, 128)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_eager(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    """Seconds per call, launches included (warmup calls compile the kernels)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def time_graph(fn: Callable[[], Any], iters: int) -> Optional[float]:
    """Seconds per call replayed from a CUDA graph; None when capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm up on the side stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0 / iters
    except Exception:  # noqa: BLE001 - an uncapturable call is reported as eager only
        return None


def copy_bandwidth(device: str, dry: bool, *_: Any) -> dict[str, Any]:
    """Device-to-device copy, counted as bytes read + bytes written per second."""
    mib = 1 if dry else 1024
    src = torch.randn(mib << 18, device=device)  # mib MiB of fp32
    dst = torch.empty_like(src)
    seconds = time_eager(lambda: dst.copy_(src), device, 2, 2 if dry else 20)
    return {"mib": mib, "seconds": seconds, "gb_s": 2 * src.numel() * 4 / seconds / 1e9}


def _decode_inputs(batch: int, context: int, shape: tuple, device: str) -> tuple:
    """One decode token per sequence, `context` tokens each (the new one included)."""
    _, num_kv_heads, group, head_dim = shape
    per_seq = -(-context // BLOCK_SIZE)
    cache_shape = (batch * per_seq, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
    tables = torch.randperm(batch * per_seq, device=device).view(batch, per_seq).int()
    q = torch.randn(batch, num_kv_heads * group, head_dim, dtype=DTYPE, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, qsl, seq_lens, tables, 1.0 / math.sqrt(head_dim)


def decode_attention(
    device: str, dry: bool, expired: Callable[[], bool], copy: dict[str, Any]
) -> list[dict[str, Any]]:
    if dry:
        cases = [(b, 32, ("tiny", 2, 2, 64)) for b in (1, 2)]
    else:
        # the goal's cases first (256 and 16-64 sequences at 8k), so a soft limit keeps them
        first = [(b, 8192, SHAPE_1B) for b in (256, 64, 16)]
        cases = first + [
            (b, c, SHAPE_1B)
            for c in (1024, 2048, 4096, 8192)
            for b in (1, 4, 16, 64, 256)
            if (b, c, SHAPE_1B) not in first
        ]
        cases += [(b, 4096, SHAPE_8B) for b in (1, 16, 64, 256)]
    rows = []
    for batch, context, shape in cases:
        if expired():
            break
        args = _decode_inputs(batch, context, shape, device)
        call = lambda args=args: paged_attention(*args)  # noqa: E731
        eager = time_eager(call, device, 1 if dry else 3, 1 if dry else 20)
        graph = None if device != "cuda" else time_graph(call, 50)
        seconds = graph if graph is not None else eager
        kv_bytes = args[1].element_size() * 2 * batch * context * shape[1] * shape[3]
        gb_s = kv_bytes / seconds / 1e9
        rows.append({
            "model": shape[0], "batch": batch, "context": context, "head_dim": shape[3],
            "us": seconds * 1e6, "eager_us": eager * 1e6,
            "graph_us": None if graph is None else graph * 1e6,
            "timing": "graph" if graph is not None else "eager",
            "kv_bytes": kv_bytes, "gb_s": gb_s, "pct_copy": 100.0 * gb_s / copy["gb_s"],
        })  # fmt: skip
        del args
    return rows


def prefill_attention(
    device: str, dry: bool, expired: Callable[[], bool], copy: dict[str, Any]
) -> list[dict[str, Any]]:
    if dry:
        cases = [(1, 32, ("tiny", 2, 2, 64))]
    else:
        cases = [(1, n, s) for s in (SHAPE_1B, SHAPE_8B) for n in (512, 2048, 8192)]
        cases += [(8, 1024, SHAPE_1B), (8, 1024, SHAPE_8B)]
    rows = []
    for seqs, seq_len, (label, num_kv_heads, group, head_dim) in cases:
        if expired():
            break
        per_seq = -(-seq_len // BLOCK_SIZE)
        cache_shape = (seqs * per_seq, BLOCK_SIZE, num_kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
        v_cache = torch.randn(cache_shape, dtype=DTYPE, device=device)
        tables = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq).int()
        num_heads = num_kv_heads * group
        q = torch.randn(seqs * seq_len, num_heads, head_dim, dtype=DTYPE, device=device)
        qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device) * seq_len
        seq_lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, qsl, seq_lens, tables, 1.0 / math.sqrt(head_dim))
        seconds = time_eager(lambda a=args: paged_attention(*a), device, 1 if dry else 2,
                             1 if dry else 10)  # fmt: skip
        # QK^T and PV over the causally visible pairs only: 4 * H * D per (query, key) pair.
        flops = 4 * num_heads * head_dim * seqs * seq_len * (seq_len + 1) // 2
        rows.append({
            "model": label, "seqs": seqs, "seq_len": seq_len, "head_dim": head_dim,
            "ms": seconds * 1e3, "tflop_s": flops / seconds / 1e12,
        })  # fmt: skip
    return rows


def engine_step(
    device: str, dry: bool, expired: Callable[[], bool], copy: dict[str, Any]
) -> list[dict[str, Any]]:
    """One forward of the whole model (eager, launches included) per step shape."""
    shape, context = (TINY, 20) if dry else (LLAMA_1B, 1024)
    batches = (1, 2) if dry else (1, 8, 32, 64, 128, 256)
    chunk = 8 if dry else 512
    # (label, new tokens per sequence, cached tokens per sequence)
    cases = [("decode", [1] * b, [context] * b) for b in batches]
    num_mixed = 1 if dry else 32
    cases.append(("mixed", [1] * num_mixed + [chunk], [context] * num_mixed + [0]))
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = max(len(q) for _, q, _ in cases) * per_seq + chunk // BLOCK_SIZE + 1
    model = RandomLlama(
        shape, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_pos=context + chunk + 1,
        dtype=torch.float32 if dry else DTYPE, device=device,
    )  # fmt: skip
    rows = []
    for label, q_lens, context_lens in cases:
        if expired():
            break
        step, _ = make_step(q_lens, context_lens, block_size=BLOCK_SIZE, vocab=shape.vocab,
                            device=device)  # fmt: skip
        seconds = time_eager(lambda s=step: model.forward(s), device, 1 if dry else 2,
                             1 if dry else 5)  # fmt: skip
        new_tokens = sum(q_lens)
        rows.append({
            "model": "tiny" if dry else "Llama-3.2-1B", "kind": label,
            "batch": len(q_lens), "new_tokens": new_tokens, "context": context,
            "ms": seconds * 1e3, "tokens_s": new_tokens / seconds,
        })  # fmt: skip
    return rows
