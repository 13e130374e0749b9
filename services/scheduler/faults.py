"""The scheduler's answers to worker faults: a lost worker, a failed step.

A part of `Scheduler` (services/scheduler/scheduler.py), kept in its own module because it is
its own concern: the methods run on the scheduler's state and keep the same invariants
(services/scheduler/integrity.py) after every call. The server calls them when the worker link
reports a loss or a `WorkerFailure`.

A failed step fails only the requests it can be pinned on, found by bisection
(`bisect_failed_step`): a step of one request pins the failure on it; a step of several puts
them all back by recompute (the worker drops their state with the next plan), the suspects
split in two: the first half goes back to the head of the queue, the second half is held
aside until a step completes (then it rejoins the head; so it does when nothing else is left
to run). A request counts as a suspect until it is part of a completed step; when no request of
a failed step is a suspect any more (a fault that needs a later position), all are again. Each
failure halves the suspects around the culprit, so it is soon alone in a failing step; a request
in `MAX_FAILED_STEPS` failed steps fails in any case, which bounds how long bisection can take.
Dynamic and static batching cannot recompute part of a batch: there a failed step fails all of
its requests, as before. Waiting requests are never failed by a step.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.request import Request, RequestStatus
from shared.protocol.engine_channel import RequestOutput

# A request that was part of this many failed steps ends with the step's error even when not
# alone in one (bisection of a full batch needs about log2(max_num_seqs) failures).
MAX_FAILED_STEPS = 16


class WorkerFaults:
    """Mixed into Scheduler; uses its `_live`, `_waiting`, `_batch`, `pool`, `_clock`,
    `_rules`, `_inflight`, `prefix_cache`, `config`, `_fresh_state` and `_mark_finished`.
    `_reset_faults` is called by its __init__."""

    def _reset_faults(self) -> None:
        self._held: list[list[Request]] = []  # bisection's set-aside groups, next one first
        self._passed: set[str] = set()  # rids part of a completed step (not suspects)
        self._num_failed_steps: dict[str, int] = {}  # rid -> failed steps it was part of

    # ---- a failed step: bisection ------------------------------------------------------------

    def bisect_failed_step(self, code: str, message: str) -> list[RequestOutput]:
        """The worker failed the oldest step in flight: the outputs of the requests the failure
        is pinned on (see the module docstring; the suspects are the requests of every step in
        flight: with overlap the next plan was built on the failed one); the others go back by
        recompute. Waiting requests (not in the steps) are untouched. The worker's batch needs a
        reset: the next plan resets it and sends every running request again. With overlap,
        blocks registered while the failed step was in flight may miss KV: the prefix cache is
        emptied. What the failed steps filled is never registered."""
        rids = [rid for flight in self._inflight for rid in flight.rids]
        if len(self._inflight) > 1 or self.config.async_scheduling:
            self.prefix_cache.reset()
        else:  # what completed steps queued, before their requests' tables are dropped
            self.prefix_cache.flush()
        self._inflight.clear()
        self._batch.forget_worker()
        step = [self._live[r] for r in dict.fromkeys(rids)
                if r in self._live and self._live[r].status is RequestStatus.RUNNING]  # fmt: skip
        counts = self._num_failed_steps
        for req in step:
            counts[req.rid] = counts.get(req.rid, 0) + 1
        if len(step) == 1 or not self._rules.preempts_to_queue:
            pinned = step
        else:
            pinned = [r for r in step if counts[r.rid] >= MAX_FAILED_STEPS]
        outputs = self.fail_step([r.rid for r in pinned], code, message)
        rest = [r for r in step if r not in pinned]
        if not rest:
            return outputs
        suspects = [r for r in rest if r.rid not in self._passed]
        if not suspects:  # every one completed a step before: suspects again, all of them
            self._passed.difference_update(r.rid for r in rest)
            suspects = rest
        cleared = [r for r in rest if r.rid in self._passed]
        if len(suspects) == 1:  # run it alone next: a failure then is its own
            first, later = suspects, cleared
        else:
            half = (len(suspects) + 1) // 2
            first, later = suspects[:half] + cleared, suspects[half:]
        for req in rest:
            self._batch.drop(req)  # frees its blocks; the next plan releases it at the worker
            req.reset_for_recompute()
            req.status = RequestStatus.WAITING
        for req in first:
            self._waiting.add_preempted(req)
        if later:
            self._held.append(sorted(later, key=lambda r: r.seq_no))
        return outputs

    def step_completed(self, rids: Iterable[str]) -> None:
        """Called with the rids of each step whose result arrived: they are no suspects, and
        the next held group (if any) rejoins the head of the queue."""
        self._passed.update(rids)
        if len(self._passed) > 2 * len(self._live) + 64:  # forget finished rids now and then
            self._passed.intersection_update(self._live)
            self._num_failed_steps = {
                r: n for r, n in self._num_failed_steps.items() if r in self._live
            }
        self._release_held()

    def release_held_if_idle(self) -> None:
        """Called before schedule(): with nothing waiting or running, a held group would wait
        for a step that never comes; it rejoins the queue instead."""
        if self._held and len(self._waiting) == 0 and len(self._batch) == 0:
            self._release_held()

    def _release_held(self) -> None:
        if self._held:
            for req in self._held.pop(0):
                self._waiting.add_preempted(req)

    def is_held(self, req: Request) -> bool:
        """True while bisection holds `req` aside (waiting, but not in the queue)."""
        return any(req in group for group in self._held)

    @property
    def num_held(self) -> int:
        return sum(len(group) for group in self._held)

    def _remove_waiting(self, req: Request) -> None:
        """Take a waiting request out of the queue, or out of bisection's held groups."""
        for group in self._held:
            if req in group:
                group.remove(req)
                self._held = [g for g in self._held if g]
                return
        self._waiting.remove(req)

    # ---- the worker lost, a failure pinned -------------------------------------------------

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """The worker is lost: every live request ends with an error; all state is reset."""
        now = self._clock()
        outputs = []
        for req in list(self._live.values()):
            self._mark_finished(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
        self._fresh_state(self.pool.num_blocks)  # a new pool: the prefix cache is empty
        self._reset_faults()
        self._inflight.clear()
        return outputs

    def fail_step(self, rids: Iterable[str], code: str, message: str) -> list[RequestOutput]:
        """A failure pinned on `rids`: they end with `code`; the worker drops their state with
        the next plan. Waiting requests and requests outside `rids` go on. Called by
        `bisect_failed_step` (after it has cleared the plans in flight)."""
        now = self._clock()
        outputs = []
        for rid in rids:
            req = self._live.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING:
                self._remove_waiting(req)
            else:
                self._batch.drop(req)
            self._mark_finished(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
        return outputs

    def requeue_all(self, max_retries: int, code: str, message: str) -> list[RequestOutput]:
        """The worker is lost with all its state: every request it held restarts from the
        waiting queue by recompute (its generated tokens kept, so no token is sent twice),
        unless it already restarted `max_retries` times: then it ends with `code`. Waiting
        requests keep their places. The pool starts empty (the new worker's is)."""
        live = sorted(self._live.values(), key=lambda r: r.seq_no)
        # and an empty prefix cache: the KV is gone. The first plan resets the worker's batch
        # (a worker that only reconnected still holds the old one).
        self._fresh_state(self.pool.num_blocks)
        self._reset_faults()  # held requests are live and waiting: they rejoin the queue below
        self._inflight.clear()
        now = self._clock()
        outputs = []
        for req in live:
            if req.status is RequestStatus.WAITING:
                self._waiting.add(req)
                continue
            req.reset_for_recompute()
            if req.num_worker_retries >= max_retries:
                self._mark_finished(req, "error", now)
                outputs.append(req.output([], [], "error", code, message))
                continue
            req.num_worker_retries += 1
            req.status = RequestStatus.WAITING
            self._waiting.add_preempted(req)
        return outputs
