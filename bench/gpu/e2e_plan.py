"""What `bench/gpu/e2e.py` runs, per mode: sizes, flags and time limits (standard library only).

The device plan fits 300 s on one H200: the limits of the stages run one after another (the
models are drawn beside gpu_check) add up to at most the overall limit less the report's reserve
(tests/unit/test_gpu_e2e_plan.py checks it), in the order the figures matter: install, kernel
checks (bf16, per-check seconds, decode attention against copy bandwidth), the serving bursts
(SmolLM2, then 1B-shaped), transformers' static batch, correctness against transformers, and
last the pipelining comparison, which the overall deadline trims first. Expected durations are
not measured yet (nothing has run on a GPU); every limit is an upper bound and each stage's
results are written as it ends, so a run cut short still reports what it reached.

Bursts use the `mixed` workload (prompts 32-512 and outputs 16-256 tokens) at scale 0.5: all
requests sent at once, EOS ignored, the same requests for the engine and for transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Served:
    """One model's serving stages: `conveyor up` + bursts, then transformers' static batch."""

    bursts: str  # burst sizes, "64,256"
    scale: float  # workload length scale
    serve_args: tuple[str, ...]  # extra bench/gpu/e2e_serve.py flags
    serve_limit_s: float
    # bursts to serve again with the worker's step pipelining off (stage
    # `serve_<kind>-pipeline-off`, run last): throughput and device idle time, off against on
    pipeline_off_bursts: Optional[str] = None


@dataclass(frozen=True)
class Plan:
    name: str
    dry_run: bool
    device: str  # where the engine, the checks and transformers run
    dtype: str  # the served dtype (the correctness stage tests fp32 and bf16 itself)
    time_limit_s: float
    check_soft_limit_s: float  # gpu_check's own --time-limit (its alarm fires 20 s later)
    limits: dict[str, float]  # install, models, gpu_check, correctness, hf_static
    # Run the stages after `models` side by side (dry run only: on the device each stage has the
    # GPU to itself, or its figures would measure the others)
    parallel: bool
    correct_args: tuple[str, ...]
    serving: dict[str, Served]


def _serve_args(
    kv: str, max_len: int, budget: int, chunk: int, warmup: int, warm_scale: float, ready_s: float
) -> tuple[str, ...]:
    """bench/gpu/e2e_serve.py's sizing flags."""
    flags = {"kv-cache-memory": kv, "max-model-len": max_len, "max-num-batched-tokens": budget,
             "chunk-size": chunk, "warmup-prompts": warmup, "warmup-scale": warm_scale,
             "ready-timeout": ready_s}  # fmt: skip
    return tuple(item for k, v in flags.items() for item in (f"--{k}", str(v)))


DEVICE = Plan(
    name="device",
    dry_run=False,
    device="cuda",
    dtype="bfloat16",
    time_limit_s=300.0,
    check_soft_limit_s=45.0,
    limits={
        "install": 15.0,
        "models": 60.0,  # beside gpu_check
        "gpu_check": 70.0,
        "correctness": 35.0,
        "hf_static": 40.0,
    },
    parallel=False,
    correct_args=("--num-prompts", "8", "--prompt-len", "20,60", "--new-tokens", "16"),
    serving={
        # ~2.2 GiB of KV at 256 x 384 tokens; 8 GiB leaves room
        "smollm2": Served(
            "64,256",
            0.5,
            _serve_args("8GiB", 512, 8192, 512, 32, 0.1, 45),
            serve_limit_s=55.0,
            # the smallest model has the shortest device steps: the host's share is largest
            pipeline_off_bursts="256",
        ),
        # ~12 GiB of KV at 1,024 x 384 tokens (32 KiB per token in bf16)
        "llama-1b": Served(
            "256,1024",
            0.5,
            _serve_args("32GiB", 512, 8192, 512, 32, 0.1, 45),
            serve_limit_s=65.0,
        ),
    },
)

DRY_RUN = Plan(
    name="dry-run",
    dry_run=True,
    device="cpu",
    dtype="float32",
    time_limit_s=600.0,  # a shared 2-core machine; the test's own timeout is tighter
    check_soft_limit_s=1.0,  # a few kernel checks, then it stops itself (reported)
    limits={
        "install": 60.0,
        "models": 60.0,
        "gpu_check": 90.0,
        "correctness": 150.0,
        "hf_static": 150.0,
    },
    parallel=True,
    # prompts of one chunk each; mixed steps (a prefill beside a decode) still occur
    correct_args=("--num-prompts", "2", "--prompt-len", "4,12", "--new-tokens", "2"),
    serving={
        kind: Served(
            "2,4",
            0.05,
            _serve_args("64MiB", 256, 256, 64, 1, 0.05, 120),
            serve_limit_s=150.0,
        )
        for kind in ("smollm2", "llama-1b")
    },
)

PLANS = {"device": DEVICE, "dry-run": DRY_RUN}


def sequential_limit_s(plan: Plan) -> float:
    """The limits of the stages run one after another, the pipelining comparison left out (it
    runs last, on what time is left): what must fit the overall limit."""
    lim = plan.limits
    serving = sum(s.serve_limit_s for s in plan.serving.values())
    return (lim["install"] + max(lim["models"], lim["gpu_check"]) + serving + lim["hf_static"]
            + lim["correctness"])  # fmt: skip
