"""The textbook analytical model of static vs continuous batching, fed with a real workload.

The model takes a step to cost the same whatever it holds (true of GPU decode steps, which are
bound by reading the weights), and counts steps:
* static: requests are cut into batches of B in arrival order; a batch runs until its longest
  output is done, so  T_static = sum over batches of max(output_len in batch) x t_step;
* continuous ("queue-limited"): T_cont = max(output_len) x t_step x max(N / B, 1), i.e. the
  longest request's length, repeated once per "wave" of B requests.
Throughput is the same token count over each time, so the predicted ratio is T_static / T_cont.
Both are given the step time measured in the run of their own mode.

Beside it we compute a tighter, packing bound for continuous batching that this model
leaves out: B slots each produce one token per step, so at least ceil(sum(output_len) / B)
steps, and never fewer than the longest output: T_pack = max(max_out, ceil(sum / B)) x t_step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prediction:
    """Step counts and, given step times, times and the continuous / static throughput ratio."""

    static_steps: int
    continuous_steps_queue_limited: float
    continuous_steps_packing: int
    static_time_s: float
    continuous_time_s_queue_limited: float
    continuous_time_s_packing: float

    @property
    def ratio_queue_limited(self) -> float:
        return self.static_time_s / self.continuous_time_s_queue_limited

    @property
    def ratio_packing(self) -> float:
        return self.static_time_s / self.continuous_time_s_packing


def static_steps(output_lens: Sequence[int], batch_size: int) -> int:
    """Decode steps of static batching: each batch of `batch_size` (in order) runs its max."""
    _check(output_lens, batch_size)
    return sum(max(output_lens[i : i + batch_size]) for i in range(0, len(output_lens), batch_size))


def continuous_steps_queue_limited(output_lens: Sequence[int], batch_size: int) -> float:
    """The queue-limited continuous model: max(output) x max(N / B, 1) steps."""
    _check(output_lens, batch_size)
    return max(output_lens) * max(len(output_lens) / batch_size, 1.0)


def continuous_steps_packing(output_lens: Sequence[int], batch_size: int) -> int:
    """Lower bound with B slots each producing one token a step: max(max_out, ceil(sum / B))."""
    _check(output_lens, batch_size)
    return max(max(output_lens), math.ceil(sum(output_lens) / batch_size))


def predict(
    output_lens: Sequence[int], batch_size: int, static_step_s: float, continuous_step_s: float
) -> Prediction:
    """The model's figures for one workload, with each mode's measured step time."""
    if not (static_step_s > 0 and continuous_step_s > 0):
        raise ValueError("step times must be > 0")
    s = static_steps(output_lens, batch_size)
    c_queue = continuous_steps_queue_limited(output_lens, batch_size)
    c_pack = continuous_steps_packing(output_lens, batch_size)
    return Prediction(
        static_steps=s,
        continuous_steps_queue_limited=c_queue,
        continuous_steps_packing=c_pack,
        static_time_s=s * static_step_s,
        continuous_time_s_queue_limited=c_queue * continuous_step_s,
        continuous_time_s_packing=c_pack * continuous_step_s,
    )


def _check(output_lens: Sequence[int], batch_size: int) -> None:
    if not output_lens:
        raise ValueError("no requests")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
