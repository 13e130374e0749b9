"""What the scheduler reports: one `StepRecord` per plan (the server logs it as the step log,
from which the benchmark draws its timeline picture) and running totals for `stats()`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from services.scheduler.block_pool import BlockPool
from services.scheduler.step import BuiltStep, StepBuilder
from shared.step_cost import StepShape


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one `schedule()` decided. The lists are parallel, in batch order (read-only by
    convention)."""

    step_id: int
    time: float  # scheduler clock when the plan was built
    rids: list[str]
    num_tokens: list[int]
    is_prefill: list[bool]  # False: a decode (the token sampled last step)
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int  # after this step's admissions
    num_running: int  # slots held, static padding included
    batch_utilization: float  # num_running / max_num_seqs
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preemptions: int  # in this step
    num_released: int  # requests the worker drops before this step
    # prefix-cache lookups of requests (re)scheduled in this step, in tokens: looked up, and
    # found cached (those requests compute only the rest)
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # on the steps the step-time predictor learns from (step_costs.py): the step's shape and
    # the time predicted for it when built (None before the first fit)
    shape: Optional[StepShape] = None
    predicted_s: Optional[float] = None

    def to_dict(self) -> dict[str, object]:
        """A flat map for one JSON log line (`shape` and `predicted_s` only where known)."""
        out: dict[str, object] = {
            "step_id": self.step_id,
            "time": self.time,
            "rids": self.rids,
            "num_tokens": self.num_tokens,
            "is_prefill": self.is_prefill,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "batch_utilization": self.batch_utilization,
            "num_kv_blocks_used": self.num_kv_blocks_used,
            "num_kv_blocks_total": self.num_kv_blocks_total,
            "num_preemptions": self.num_preemptions,
            "num_released": self.num_released,
            "num_prefix_cache_queries": self.num_prefix_cache_queries,
            "num_prefix_cache_hits": self.num_prefix_cache_hits,
        }
        if self.shape is not None:  # rows, tokens, samples, attention pairs, KV, chunk
            out["shape"] = [*dataclasses.astuple(self.shape)]
            out["predicted_s"] = self.predicted_s
        return out


@dataclass(slots=True)
class Counters:
    """Running totals since start (monotonic, like Prometheus counters)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_output_tokens: int = 0
    num_admitted: int = 0
    num_resumptions_admitted: int = 0  # admitted with outputs of an earlier attempt
    num_rejected: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)  # by finish reason

    def count_step(self, record: StepRecord) -> None:
        self.num_steps += 1
        self.num_prefill_tokens += record.num_prefill_tokens
        self.num_decode_tokens += record.num_decode_tokens

    def count_finish(self, reason: str) -> None:
        self.num_finished[reason] = self.num_finished.get(reason, 0) + 1

    def as_stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_admitted": self.num_admitted,
            "num_resumptions_admitted": self.num_resumptions_admitted,
            "num_rejected": self.num_rejected,
        }
        for reason, n in self.num_finished.items():
            out[f"num_finished_{reason}"] = n
        return out


def step_record(
    built: BuiltStep,
    step: StepBuilder,
    now: float,
    num_waiting: int,
    num_running: int,
    max_num_seqs: int,
    pool: BlockPool,
    shape: Optional[StepShape] = None,
    predicted_s: Optional[float] = None,
) -> StepRecord:
    """The record of a plan just built (after its admissions and preemptions)."""
    plan = built.plan
    return StepRecord(
        step_id=plan.step_id,
        time=now,
        rids=built.rids,
        num_tokens=built.num_tokens,
        is_prefill=built.is_prefill,
        num_prefill_tokens=built.num_prefill_tokens,
        num_decode_tokens=plan.num_scheduled_tokens - built.num_prefill_tokens,
        num_waiting=num_waiting,
        num_running=num_running,
        batch_utilization=num_running / max_num_seqs,
        num_kv_blocks_used=pool.num_used,
        num_kv_blocks_total=pool.num_blocks,
        num_preemptions=step.num_preemptions,
        num_released=len(plan.released_slots),
        num_prefix_cache_queries=step.num_cache_queries,
        num_prefix_cache_hits=step.num_cache_hits,
        shape=shape,
        predicted_s=predicted_s,
    )
