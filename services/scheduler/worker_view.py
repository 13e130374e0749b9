"""The scheduler's mirror of the worker's persistent batch: which request holds each slot, in
the worker's batch order, the slots released since the last plan, and the plan the next one
extends.

Plans carry only changes (docs/design/step_contract.md), so the scheduler must know exactly what
the worker holds: a request is held from the plan that sends its `NewSequence` until a plan
releases its slot. A slot released by one plan may be taken again by the next one (the worker
releases before it adds).

The worker's batch order is the order in which its sequences joined (worker/held_batch.py), and
a result lists its samples in that order, without rids: `order` keeps the same order, so the
scheduler maps a result's tokens to requests by position.
"""

from __future__ import annotations

import heapq
from typing import Optional

from services.scheduler.request import Request


class WorkerView:
    def __init__(self) -> None:
        self.released: list[int] = []  # slots the next plan releases
        self.trims: dict[int, int] = {}  # slot -> table length the next plan cuts it to
        self.prev_step_id: Optional[int] = None  # the last plan built; None: the next resets
        # slot -> request, in the worker's batch order (as of the plans built so far)
        self.order: dict[int, Request] = {}
        self._free: list[int] = []  # a heap of released slots: low slots first
        self._next_slot = 0
        # `order`'s requests and rids as lists, rebuilt only after it changed: a steady step
        # of decodes (every held sequence samples) shares them instead of building its own
        self._lists: Optional[tuple[list[Request], list[str]]] = None
        self._index: dict[str, int] = {}  # rid -> its position in `order` (with `_lists`)

    @property
    def num_held(self) -> int:
        """Slots taken and not released."""
        return len(self.order)

    def take_slot(self, req: Request) -> int:
        """A slot for `req`, which the next plan sends as new: it joins the end of the batch."""
        slot = heapq.heappop(self._free) if self._free else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        self.order[slot] = req
        self._lists = None
        return slot

    def release(self, slot: int) -> None:
        """The request in `slot` leaves the worker's batch with the next plan."""
        del self.order[slot]
        self._lists = None
        self.trims.pop(slot, None)
        self.released.append(slot)
        heapq.heappush(self._free, slot)

    def trim(self, slot: int, num_blocks: int) -> None:
        """The table of the sequence in `slot` is cut to `num_blocks` by the next plan."""
        self.trims[slot] = num_blocks

    def take_trims(self) -> tuple[list[int], list[int]]:
        """The next plan's trims, as (slots, lengths)."""
        if not self.trims:
            return [], []
        trims, self.trims = self.trims, {}
        return list(trims), list(trims.values())

    def take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    def held_lists(self) -> tuple[list[Request], list[str]]:
        """Every held request and its rid, in batch order (shared, read-only lists)."""
        if self._lists is None:
            reqs = list(self.order.values())
            rids = [r.rid for r in reqs]
            self._lists = (reqs, rids)
            self._index = {rid: i for i, rid in enumerate(rids)}
        return self._lists

    def held_lists_without(self, rids: list[str]) -> tuple[list[Request], list[str]]:
        """`held_lists()` less the held requests `rids` (a few: prefill chunks that do not
        sample), as new lists: copied in C, not rebuilt per request."""
        reqs, all_rids = self.held_lists()
        reqs, all_rids = reqs[:], all_rids[:]
        for i in sorted((self._index[rid] for rid in rids), reverse=True):
            del reqs[i]
            del all_rids[i]
        return reqs, all_rids

    def reset(self) -> None:
        """The worker's batch is gone or unknown (a failed step, a new worker): the next plan
        resets it. The caller forgets every request's slot."""
        self.released = []
        self.trims = {}
        self.prev_step_id = None
        self.order = {}
        self._free = []
        self._next_slot = 0
        self._lists = None
