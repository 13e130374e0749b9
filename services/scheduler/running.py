"""The running batch and its KV blocks: admission into the batch, growth of block tables,
preemption by policy, and release (what the worker must drop with the next plan).

Only running requests hold blocks. A preempted request loses all of them and keeps its tokens;
it recomputes later (in continuous mode from the waiting queue's head, in dynamic/static mode
in place, as a member of its batch). With prefix caching its full blocks are registered before
they are freed, so its resume is mostly a cache hit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from services.scheduler.block_pool import BlockPool
from services.scheduler.policy import WaitingQueue, pick_victim
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import StepBuilder
from services.scheduler.worker_view import WorkerView


class RunningSet:
    def __init__(
        self,
        pool: BlockPool,
        policy: str,
        requeue: Optional[WaitingQueue],
        register: Optional[Callable[[Request], None]] = None,
    ) -> None:
        """`requeue`: where preempted requests go; None keeps them in the batch (in place).
        `register`: makes a request's computed full blocks findable (prefix caching), called
        before a preempted request's blocks are freed."""
        self.pool = pool
        self._register = register
        self.policy = policy
        self.requeue = requeue
        self.requests: dict[str, Request] = {}  # batch order (admission order); read-only
        self.worker = WorkerView()  # what the worker's persistent batch holds
        self.round = 0  # schedule() pass: a request preempted in this one waits for the next
        # Just-resumed requests are not taken from, unless nothing else could run at all.
        self.spare_protected = True
        # bumped whenever a request joins or leaves the batch, is preempted, or the worker's
        # batch is forgotten: a plan built at an unchanged version holds only requests that go
        # on (the steady path, services/scheduler/steady.py)
        self.version = 0

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, rid: str) -> bool:
        return rid in self.requests

    def begin_pass(self, spare_protected: bool) -> None:
        """Called before each pass of schedule() over the batch: a request preempted in this
        pass is not scheduled again in it."""
        self.round += 1
        self.spare_protected = spare_protected

    def release(self, req: Request) -> None:
        """`req` leaves the worker's batch with the next plan (its slot is free for reuse)."""
        if req.slot is not None:
            self.worker.release(req.slot)
            req.slot = None

    def forget_worker(self) -> None:
        """The worker's batch is lost or unknown: the next plan resets it and sends every
        running request again, as new, from what it has computed."""
        self.worker.reset()
        self.version += 1
        for req in self.requests.values():
            req.slot = None
            req.num_sent_blocks = 0

    def start(self, req: Request) -> None:
        """`req` joins the batch; everything it holds is prefill until it samples."""
        req.start()
        self.requests[req.rid] = req
        self.version += 1

    def drop(self, req: Request) -> None:
        """Take `req` out of the batch and free its blocks (finished, aborted, batch over)."""
        del self.requests[req.rid]
        self.version += 1
        self.pool.free(req.release_table())
        self.release(req)

    def grow(self, req: Request, num_positions: int, step: StepBuilder) -> bool:
        """Extend `req`'s table to cover `num_positions`, preempting requests ranked below it
        (static padding first) while blocks are short. False when there is nobody left to take
        from: `req` keeps what it has and waits this step (those ranked above it progress, and
        will take its blocks if they need them)."""
        pool = self.pool
        need = pool.blocks_needed(len(req.block_ids), num_positions)
        if need == 0:
            return True
        blocks = pool.allocate(need)  # None while too few are free or cached
        while blocks is None:
            victim = self._choose_victim(req)
            if victim is None:
                return False
            self.preempt(victim, step)
            blocks = pool.allocate(need)
        req.add_blocks(blocks)
        return True

    def grow_if_free(self, req: Request, num_positions: int) -> bool:
        """Extend `req`'s table only from free blocks (never preempts)."""
        need = self.pool.blocks_needed(len(req.block_ids), num_positions)
        blocks = self.pool.allocate(need) if need else []
        if blocks is None:
            return False
        req.add_blocks(blocks)
        return True

    def give_back(self, req: Request, num_positions: int) -> None:
        """Speculation: free `req`'s blocks past those covering `num_positions` (what the plans
        in flight may write); the worker's table is trimmed by the next plan. Never a
        registered block: registrations stop below its computed count."""
        keep = -(-num_positions // self.pool.block_size)
        if len(req.block_ids) <= keep:
            return
        sent = req.num_sent_blocks
        self.pool.free(req.cut_table(keep))
        if req.slot is not None and sent > keep:
            self.worker.trim(req.slot, keep)

    def touch(self) -> None:
        """Computed counts moved outside the steady path (speculation's results): a steady run
        built on them ends."""
        self.version += 1

    def allocate_for(self, req: Request, num: int) -> None:
        """An admission's blocks (the caller checked `can_allocate`)."""
        blocks = self.pool.allocate(num)
        assert blocks is not None  # the caller checked
        req.add_blocks(blocks)

    def _choose_victim(self, requester: Request) -> Optional[Request]:
        """Static padding first (its tokens are thrown away anyway), then the policy's last
        among those ranked below `requester`."""
        candidates = [r for r in self.requests.values() if r.block_ids and r is not requester]
        for req in candidates:
            if req.padding:
                return req
        return pick_victim(self.policy, candidates, requester, self.spare_protected)

    def preempt(self, req: Request, step: StepBuilder) -> None:
        """Free `req`'s blocks; it recomputes later with its generated tokens kept. Static
        padding is only evicted: it keeps its slot and is never computed again."""
        step.drop(req)
        self.version += 1
        if self._register is not None and not req.padding:
            # Its KV is complete, or (a plan in flight) will be before any later plan runs:
            # the worker runs plans in order.
            self._register(req)
        self.pool.free(req.release_table())
        self.release(req)
        req.reset_for_recompute()
        if req.padding:
            return
        step.num_preemptions += 1
        req.note_preempted(self.round, self.version)
        if self.requeue is not None:
            del self.requests[req.rid]
            req.requeue()
            self.requeue.add_preempted(req)

    def end_static_batch_if_done(self) -> None:
        """Static: once no member is live, the padding leaves and the next batch may form."""
        if self.requests and all(r.padding for r in self.requests.values()):
            for req in list(self.requests.values()):
                self.drop(req)

    def check_invariants(self, max_num_seqs: int, block_size: int) -> None:
        """Raise AssertionError unless at most `max_num_seqs` run, each is RUNNING with a table
        covering what it computed, and the worker view holds exactly the requests with a slot,
        each in its own slot. Read-only."""
        assert len(self.requests) <= max_num_seqs, "too many running"
        for rid, req in self.requests.items():
            running = req.status is RequestStatus.RUNNING or req.padding  # padding: finished
            assert req.rid == rid and running, f"{rid} runs wrongly"
            covered = req.num_computed_tokens + req.num_draft_slots
            assert len(req.block_ids) * block_size >= covered, f"{rid}: table"
            assert req.num_draft_slots >= 0, f"{rid}: draft slots"
            if req.slot is not None:
                assert self.worker.order.get(req.slot) is req, f"{rid}: slot {req.slot}"
        held = sum(1 for r in self.requests.values() if r.slot is not None)
        assert held == self.worker.num_held, "the worker view holds requests not running"
