"""The scheduler's mirror of the worker's persistent batch: which slot each request holds, the
slots released since the last plan, and the plan the next one extends.

Plans carry only changes (docs/design/step_contract.md), so the scheduler must know exactly what
the worker holds: a request is held from the plan that sends its `NewSequence` until a plan
releases its slot. A slot released by one plan may be taken again by the next one (the worker
releases before it adds).
"""

from __future__ import annotations

import heapq
from typing import Optional


class WorkerView:
    def __init__(self) -> None:
        self.num_held = 0  # slots taken and not released (as of the plans built so far)
        self.released: list[int] = []  # slots the next plan releases
        self.prev_step_id: Optional[int] = None  # the last plan built; None: the next resets
        self._free: list[int] = []  # a heap of released slots: low slots first
        self._next_slot = 0

    def take_slot(self) -> int:
        """A slot for a request the next plan sends as new."""
        self.num_held += 1
        if self._free:
            return heapq.heappop(self._free)
        self._next_slot += 1
        return self._next_slot - 1

    def release(self, slot: int) -> None:
        """The request in `slot` leaves the worker's batch with the next plan."""
        self.num_held -= 1
        self.released.append(slot)
        heapq.heappush(self._free, slot)

    def take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    def reset(self) -> None:
        """The worker's batch is gone or unknown (a failed step, a new worker): the next plan
        resets it. The caller forgets every request's slot."""
        self.num_held = 0
        self.released = []
        self.prev_step_id = None
        self._free = []
        self._next_slot = 0
