"""The scheduler's answers to worker faults: a lost worker, a failed step.

A part of `Scheduler` (services/scheduler/scheduler.py), kept in its own module because it is
its own concern: the methods run on the scheduler's state and keep the same invariants
(services/scheduler/integrity.py) after every call. The server calls them when the worker link
reports a loss or a `WorkerFailure`.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.request import RequestStatus
from shared.protocol.engine_channel import RequestOutput


class WorkerFaults:
    """Mixed into Scheduler; uses its `_live`, `_waiting`, `_batch`, `pool`, `_clock`,
    `_fresh_state` and `_mark_finished`."""

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """The worker is lost: every live request ends with an error; all state is reset."""
        now = self._clock()
        outputs = []
        for req in list(self._live.values()):
            self._mark_finished(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
        self._fresh_state(self.pool.num_blocks)  # a new pool: the prefix cache is empty
        self._inflight = None
        self._inflight_step = None
        return outputs

    def fail_step(self, rids: Iterable[str], code: str, message: str) -> list[RequestOutput]:
        """The worker failed the step in flight: the requests of that step (the ones the
        failure can be pinned on) end with `code`; the worker drops their state with the next
        plan. Waiting requests and requests outside the step go on."""
        self._inflight = None
        self._inflight_step = None
        self._inflight_filled = []  # prefix caching: what the failed step filled is withdrawn
        now = self._clock()
        outputs = []
        for rid in rids:
            req = self._live.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING:
                self._waiting.remove(req)
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
        # A worker that only reconnected still holds these: the next plan releases them.
        held = [r.rid for r in live if r.known_to_worker] + self._batch.take_released()
        self._fresh_state(self.pool.num_blocks)  # and an empty prefix cache: the KV is gone
        self._batch.released.extend(held)
        self._inflight = None
        self._inflight_step = None
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
