"""Batching modes: when waiting requests may join the running batch (the seeds' three
generations, kept side by side so the benchmark can compare them).

* `continuous` (default): any step may admit waiting requests, up to `max_num_seqs` running;
  a finished request's slot is refilled at the next step (iteration-level scheduling).
* `dynamic`: when the running batch has drained, a batch of at most `batch_size` forms as soon
  as that many wait or the oldest has waited `batch_timeout`. Finished requests leave; nobody
  joins until the batch drains.
* `static`: the same trigger, but the batch runs until its longest request is done: a finished
  request keeps its slot and keeps being computed (its tokens thrown away), as `generate()`
  does with padding. Its output is still sent when it finishes.

In dynamic and static mode the members of a batch are chosen when it forms; a preempted member
stays in the batch and recomputes later (it does not go back to the waiting queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from services.scheduler.config import SchedulerConfig
from services.scheduler.policy import WaitingQueue


@dataclass(frozen=True, slots=True)
class BatchingRules:
    mode: str
    batch_size: int
    batch_timeout: float

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> BatchingRules:
        return cls(config.batching, config.effective_batch_size, config.batch_timeout)

    @property
    def admits_every_step(self) -> bool:
        """Waiting requests may join a running batch (continuous batching)."""
        return self.mode == "continuous"

    @property
    def keeps_finished_as_padding(self) -> bool:
        return self.mode == "static"

    @property
    def preempts_to_queue(self) -> bool:
        """A preempted request goes back to the waiting queue (else it stays a batch member)."""
        return self.mode == "continuous"

    def should_form_batch(self, now: float, waiting: WaitingQueue, num_running: int) -> bool:
        """Dynamic/static: a new batch forms only when the previous one has drained."""
        if self.mode == "continuous" or num_running > 0 or len(waiting) == 0:
            return False
        if len(waiting) >= self.batch_size:
            return True
        oldest = waiting.oldest_arrival()
        return oldest is not None and now - oldest >= self.batch_timeout

    def next_timeout(self, now: float, waiting: WaitingQueue, num_running: int) -> Optional[float]:
        """Seconds until a partial batch may form, or None when no timer matters."""
        if self.mode == "continuous" or num_running > 0 or len(waiting) == 0:
            return None
        if len(waiting) >= self.batch_size:
            return 0.0
        oldest = waiting.oldest_arrival()
        if oldest is None:
            return None
        return max(0.0, oldest + self.batch_timeout - now)
