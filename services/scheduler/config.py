"""Scheduler settings: one frozen, validated dataclass; each field is also a command-line flag.

Defaults are sized for the CPU this project runs on (2 threads, SmolLM2-135M; measured on the
team's 2-core machines; docs/PERFORMANCE.md has the worker's own figures): the model's
linear layers reach ~2.3k tok/s at 128 tokens per step and ~3.6k at 512, while a 512-token
step takes ~140 ms. A 256-token budget keeps most of that
throughput and holds a running decode's inter-token gap near 100 ms even while a prompt is being
prefilled beside it. 32 sequences is where llama.cpp's own server peaks on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from services.scheduler.composition import STEP_COMPOSITIONS, StepCompositionName
from services.scheduler.slo_classes import DEFAULT_SLO_CLASSES, SloTargets, parse_slo_classes

Policy = Literal["fcfs", "priority", "short-first", "lpm", "slo"]
Batching = Literal["continuous", "dynamic", "static"]
POLICIES: tuple[str, ...] = get_args(Policy)
BATCHING_MODES: tuple[str, ...] = get_args(Batching)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = field(
        default=32,
        metadata={"help": "requests running at once (continuous); also caps batch_size"},
    )
    max_num_batched_tokens: int = field(
        default=256, metadata={"help": "token budget of one step, prefill chunks + decodes"}
    )
    chunk_size: int = field(
        default=256, metadata={"help": "at most this many prompt tokens of one request per step"}
    )
    batch_size: Optional[int] = field(
        default=None, metadata={"help": "dynamic/static batch size (none: max_num_seqs)"}
    )
    # s: dynamic/static start a partial batch after this wait (about half a CPU step: longer
    # only adds latency when requests trickle in)
    batch_timeout: float = field(
        default=0.05,
        metadata={"help": "seconds dynamic/static batching waits before a partial batch"},
    )
    # s: priority and short-first promote a request that waited this long (aging, policy.py;
    # ~50 CPU steps: long enough for the order to win most of the time, short enough that no
    # request is starved)
    max_wait: float = field(
        default=5.0,
        metadata={"help": "seconds of waiting after which priority and short-first promote a "
                  "request (aging)"},
    )  # fmt: skip
    # Waiting-queue bound; beyond it requests are rejected (overloaded) rather than left to
    # time out. Room for the simulated-GPU benchmarks' bursts (1,024 requests at once).
    max_waiting: int = field(
        default=4096, metadata={"help": "waiting requests beyond which new ones get overloaded"}
    )
    policy: Policy = field(
        default="fcfs",
        metadata={"help": "the waiting queue's order; slo: by latency-target slack, refusing "
                  "or deferring requests whose targets are predicted out of reach"},
    )  # fmt: skip
    # Named latency-target classes (services/scheduler/slo_classes.py has the syntax); only
    # `--policy slo` acts on targets.
    slo_classes: str = field(
        default=DEFAULT_SLO_CLASSES,
        metadata={"help": "latency-target classes, name:ttft_ms=N,tpot_ms=N[,on_slo_miss="
                  "reject|best_effort];... (policy slo)"},
    )  # fmt: skip
    slo_default_class: Optional[str] = field(
        default=None,
        metadata={"help": "the class of a request that names none and gives no targets (none: "
                  "no targets)"},
    )  # fmt: skip
    batching: Batching = field(
        default="continuous", metadata={"help": "continuous, or dynamic/static batches"}
    )
    # How prefill and decode share the device (services/scheduler/composition.py): one forward
    # for both under one budget, prefill-only forwards whenever prompts can run (SGLang's
    # loop), or a decode forward and then a separate prompt forward every iteration.
    step_composition: StepCompositionName = field(
        default="mixed",
        metadata={"help": "mixed: prompt chunks and decodes in one forward; prefill-first: a "
                  "prefill-only forward whenever prompts can run, else decodes; decode-first: "
                  "every iteration a decode forward, then prompts in a separate forward"},
    )  # fmt: skip
    # decode-first: prompt chunks per iteration (the seeds' PrefillDecodeScheduler: 2)
    max_prefill_chunks: int = field(
        default=2,
        metadata={"help": "decode-first: at most this many prompt chunks per iteration"},
    )
    # Fraction of the KV pool new admissions must leave free, so that running decodes can grow
    # for a while before anyone must be preempted.
    watermark: float = field(
        default=0.01, metadata={"help": "fraction of the KV pool admissions leave free"}
    )
    # Automatic prefix caching: full KV blocks are kept by content and a request whose prompt
    # starts with cached blocks computes only the rest (services/scheduler/block_pool.py).
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "keep full KV blocks by content: a prompt that starts with cached "
                  "blocks computes only the rest"},
    )  # fmt: skip
    # Overlap scheduling: plan N+1 is built and sent while step N runs, assuming every running
    # request goes on (one that finished at step N computes one extra, discarded token). On by
    # default: outputs are the same either way (tests/e2e/test_async_scheduling.py, the whole
    # e2e suite runs with it), and the worker no longer waits for the scheduler between steps
    # (docs/PERFORMANCE.md). `--no-async-scheduling`: one plan in flight at a time.
    async_scheduling: bool = field(
        default=True,
        metadata={
            "help": "overlap scheduling: send plan N+1 while the worker runs step N (a finished "
            "request runs one extra, discarded step; same outputs); --no-async-scheduling: one "
            "plan in flight at a time"
        },
    )

    # Speculative decoding: the worker proposes (`--speculative ngram|draft`, a worker setting:
    # it holds the histories); the scheduler gives each decode at most this many drafts per
    # step, with their KV slots and token budget (docs/design/speculation.md).
    num_speculative_tokens: int = field(
        default=4,
        metadata={"help": "most draft tokens per request per step when the worker speculates "
                  "(--speculative); 0: no drafts"},
    )  # fmt: skip

    # Not a user switch: with async scheduling, plan N+1 leaves at once when steps are short
    # next to the scheduler's own path (a GPU's few ms) and is held until shortly before step N
    # is expected to end when they are long (a CPU worker's 100-600 ms), so that requests
    # arriving meanwhile join it; the rule decides itself from the measured step times
    # (services/scheduler/dispatch.py). Tests and experiments may turn it off.
    just_in_time_plans: bool = field(
        default=True,
        metadata={
            "internal": True,
            "help": "with async scheduling, hold plan N+1 until shortly before step N is "
            "expected to end when steps are long (decided from measured step times); false: "
            "always send it at once",
        },
    )
    # disaggregation (docs/design/disaggregation.md): a prefill engine's lease on a hand-over
    lease_timeout_s: float = field(
        default=3.0,
        metadata={"help": "a prefill engine frees a hand-over's KV blocks this many seconds "
                  "after its first token unless the frontend released them earlier"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        problems = config_problems(self)
        if problems:
            raise ValueError("invalid scheduler config: " + "; ".join(problems))

    @property
    def slo_class_targets(self) -> dict[str, SloTargets]:
        """The parsed `slo_classes` (valid: checked in __post_init__)."""
        return parse_slo_classes(self.slo_classes)

    @property
    def max_plans_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1

    @property
    def effective_batch_size(self) -> int:
        return self.max_num_seqs if self.batch_size is None else self.batch_size


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_problems(c: SchedulerConfig) -> list[str]:
    """Every reason `c` is invalid; empty when valid."""
    out: list[str] = []
    for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_waiting",
                 "max_prefill_chunks"):  # fmt: skip
        v = getattr(c, name)
        if not _is_int(v) or v < 1:
            out.append(f"{name} must be an integer >= 1")
    if out:
        return out
    # Every running decode must get its token every step: the budget must cover them all.
    if not _is_int(c.num_speculative_tokens) or not 0 <= c.num_speculative_tokens <= 64:
        out.append("num_speculative_tokens must be an integer in [0, 64]")
    if c.max_num_batched_tokens < c.max_num_seqs:
        out.append("max_num_batched_tokens must be >= max_num_seqs")
    if c.batch_size is not None and (
        not _is_int(c.batch_size) or not 1 <= c.batch_size <= c.max_num_seqs
    ):
        out.append("batch_size must be an integer in [1, max_num_seqs] (or None)")
    for name in ("batch_timeout", "max_wait"):
        v = getattr(c, name)
        if not _is_num(v) or v < 0:
            out.append(f"{name} must be a number >= 0")
    if not _is_num(c.lease_timeout_s) or c.lease_timeout_s <= 0:
        out.append("lease_timeout_s must be a number > 0")
    if not _is_num(c.watermark) or not 0.0 <= c.watermark < 1.0:
        out.append("watermark must be in [0, 1)")
    for name in ("enable_prefix_caching", "async_scheduling", "just_in_time_plans"):
        if not isinstance(getattr(c, name), bool):
            out.append(f"{name} must be a bool")
    if c.policy not in POLICIES:
        out.append(f"policy must be one of {', '.join(POLICIES)}")
    if c.batching not in BATCHING_MODES:
        out.append(f"batching must be one of {', '.join(BATCHING_MODES)}")
    try:
        classes = parse_slo_classes(c.slo_classes) if isinstance(c.slo_classes, str) else None
    except ValueError as e:
        classes = {}
        out.append(str(e))
    if classes is None:
        out.append("slo_classes must be a string")
    elif c.slo_default_class is not None and c.slo_default_class not in classes:
        out.append(f"slo_default_class {c.slo_default_class!r} is not one of slo_classes")
    if c.step_composition not in STEP_COMPOSITIONS:
        out.append(f"step_composition must be one of {', '.join(STEP_COMPOSITIONS)}")
    return out
