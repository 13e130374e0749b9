"""`--dtype auto` on CPU: bf16 or fp32, decided by timing the model's own GEMMs on this machine.

CPU flag names say little: an `amx_bf16` host may not enable AMX for the guest, and torch's bf16
GEMM on an AVX2-only CPU runs at ~1/5 of fp32. So the worker times a short burst of the model's
linear-layer shapes (decode-sized and prefill-sized rows) in both dtypes and picks bf16 only when
it is at least BF16_MIN_SPEEDUP times faster. The result, with its figures, is cached per machine
in `$CONVEYOR_CACHE_DIR/dtype/<key>.json` (key: CPU model and flags, torch version, the shapes),
under a file lock so that several ranks on one machine share one decision. CONVEYOR_AUTO_DTYPE
pins the choice without a probe (services.worker.config.resolve_dtype; tests use it).

Robust on a shared machine: the two dtypes are timed in ROUNDS interleaved rounds (the order
alternating) and compared by their medians, so a burst of other work hits both alike; a ratio
within NOISE of the threshold is measured again with more rounds (up to MAX_ROUNDS). The cache
records when the probe ran and the load average besides it (per core, before and after); a
decision taken on a busy machine (load >= QUIET_LOAD) is probed again at the next start that
finds the machine quiet, so busy figures do not stay forever.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from kernels.cpu_ext import cpu_identity
from services.worker.weights import ModelArgs

BF16_MIN_SPEEDUP = 1.5
PROBE_ROWS = (32, 256)  # a decode batch and a prefill chunk
PROBE_SECONDS = 0.04  # per dtype, row count and round (after one warm-up call of each shape)
ROUNDS = 5  # interleaved rounds; the medians decide
MAX_ROUNDS = 15  # a ratio near the threshold is measured again, up to this many rounds in all
NOISE = 0.1  # "near": within 10% of BF16_MIN_SPEEDUP
QUIET_LOAD = 0.5  # 1-minute load average per core besides the probe below which it is quiet


@dataclass(frozen=True, slots=True)
class DtypeDecision:
    dtype: str  # "float32" | "bfloat16"
    gflops: dict[str, float]  # dtype -> median GFLOP/s over the probe shapes
    source: str  # "probe" | "cache"
    rounds: int = 0  # interleaved rounds the medians are over
    load: float = 0.0  # load average per core besides the probe when it ran
    probed_at: str = ""  # when it ran (UTC, ISO 8601)


def linear_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """(in, out) features of one layer's linear layers (fused qkv and gate/up, as the model)."""
    hd, d = args.hidden_size, args.head_dim
    qkv = (args.num_heads + 2 * args.num_kv_heads) * d
    return [
        (hd, qkv),
        (args.num_heads * d, hd),
        (hd, 2 * args.intermediate_size),
        (args.intermediate_size, hd),
    ]


def measure_gflops(shapes: list[tuple[int, int]], dtype: torch.dtype) -> float:
    """GFLOP/s of F.linear over `shapes` at PROBE_ROWS rows, in `dtype` (current threads)."""
    gen = torch.Generator().manual_seed(0)
    flops, seconds = 0.0, 0.0
    for rows in PROBE_ROWS:
        pairs = [
            (
                torch.randn(rows, k, generator=gen).to(dtype),
                torch.randn(n, k, generator=gen).to(dtype),
            )
            for k, n in shapes
        ]
        with torch.inference_mode():
            for x, w in pairs:  # warm-up: first calls pick kernels and pack
                torch.nn.functional.linear(x, w)
            start = time.perf_counter()
            rounds = 0
            while time.perf_counter() - start < PROBE_SECONDS or rounds == 0:
                for x, w in pairs:
                    torch.nn.functional.linear(x, w)
                rounds += 1
            seconds += time.perf_counter() - start
        flops += rounds * sum(2.0 * rows * k * n for k, n in shapes)
    return flops / seconds / 1e9


def choose(gflops: dict[str, float]) -> str:
    """bfloat16 only when it is clearly faster than float32 on these shapes."""
    return "bfloat16" if gflops["bfloat16"] >= BF16_MIN_SPEEDUP * gflops["float32"] else "float32"


def near_threshold(gflops: dict[str, float]) -> bool:
    """Whether the ratio is within NOISE of the threshold (then more rounds are taken)."""
    ratio = gflops["bfloat16"] / max(gflops["float32"], 1e-9)
    return abs(ratio / BF16_MIN_SPEEDUP - 1.0) < NOISE


def load_per_core() -> float:
    """The 1-minute load average per CPU this process may use (other work on the machine)."""
    return os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0)))


def probe(shapes: list[tuple[int, int]], load_fn: Callable[[], float] = load_per_core) -> dict:
    """Interleaved rounds of both dtypes; more rounds while the medians sit near the
    threshold. Returns the cache record (medians, rounds, load, time)."""
    load_before = load_fn()
    samples: dict[str, list[float]] = {name: [] for name in _DTYPES}
    medians: dict[str, float] = {}
    rounds = 0
    while rounds < ROUNDS or (near_threshold(medians) and rounds < MAX_ROUNDS):
        order = _DTYPES if rounds % 2 == 0 else _DTYPES[::-1]
        for name in order:
            samples[name].append(measure_gflops(shapes, getattr(torch, name)))
        rounds += 1
        medians = {name: statistics.median(v) for name, v in samples.items()}
    load = max(load_before, load_fn())
    return {"gflops": medians, "samples": samples, "rounds": rounds, "load": load,
            "quiet": load < QUIET_LOAD, "probed_at": _utc_now(), "shapes": shapes}  # fmt: skip


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def probe_key(shapes: list[tuple[int, int]]) -> str:
    text = "|".join((cpu_identity(), torch.__version__, repr(shapes), repr(PROBE_ROWS)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def decide_cpu_dtype(
    args: ModelArgs, cache_dir: Path, load_fn: Callable[[], float] = load_per_core
) -> DtypeDecision:
    """The cached decision for this machine and model shapes, else a fresh probe (cached).
    Called once per worker start when dtype is auto on CPU; a file lock serialises ranks. A
    cached decision taken while the machine was busy is probed again when it is quiet now."""
    shapes = linear_shapes(args)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{probe_key(shapes)}.json"
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)
        if cached is not None and (cached.get("quiet", True) or load_fn() >= QUIET_LOAD):
            return _decision(cached, "cache")
        record = probe(shapes, load_fn)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
        return _decision(record, "probe")


def _decision(record: dict, source: str) -> DtypeDecision:
    gflops = record["gflops"]
    rounds, load = int(record.get("rounds", 1)), float(record.get("load", 0.0))
    return DtypeDecision(choose(gflops), gflops, source, rounds, load, record.get("probed_at", ""))


def resolve_auto_dtype(args: ModelArgs, cache_dir: Path, log: Any) -> str:
    """What "auto" means on this CPU when CONVEYOR_AUTO_DTYPE does not pin it (config.
    resolve_dtype handles that): the (cached) probe's choice, logged once with its figures."""
    decision = decide_cpu_dtype(args, cache_dir)
    log.info(
        "dtype_auto",
        dtype=decision.dtype,
        source=decision.source,
        gflops={k: round(v, 1) for k, v in decision.gflops.items()},
        bf16_min_speedup=BF16_MIN_SPEEDUP,
        rounds=decision.rounds,
        load_per_core=round(decision.load, 2),
        probed_at=decision.probed_at,
    )
    return decision.dtype


_DTYPES = ("float32", "bfloat16")


def _read(path: Path) -> Optional[dict]:
    """The cached record, or None when absent or unreadable (then the probe runs again). A
    record of the first probe (figures only) reads as quiet, one round."""
    try:
        record = json.loads(path.read_text())
        gflops = record["gflops"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(gflops, dict) or any(
        not isinstance(gflops.get(n), (int, float)) for n in _DTYPES
    ):
        return None
    record["gflops"] = {n: float(gflops[n]) for n in _DTYPES}
    return record
