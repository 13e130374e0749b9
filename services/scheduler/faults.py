"""The scheduler's answer to a failed step: bisection (`Bisection`), a part of the core.

The server calls `Scheduler.bisect_failed_step` when the worker link reports a `WorkerFailure`
(a lost worker is `Scheduler.requeue_all`, which rebuilds the core's parts). The scheduler's
invariants hold after every call.

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

from collections.abc import Callable, Iterable

from services.scheduler.batching import BatchingRules
from services.scheduler.inflight import InFlightSteps
from services.scheduler.live import LiveRequests
from services.scheduler.policy import WaitingQueue
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request, RequestStatus
from services.scheduler.running import RunningSet
from shared.protocol.engine_channel import RequestOutput

# A request that was part of this many failed steps ends with the step's error even when not
# alone in one (bisection of a full batch needs about log2(max_num_seqs) failures).
MAX_FAILED_STEPS = 16


class Bisection:
    """Owns bisection's state: the groups held aside, the rids that passed a step, the failed
    steps per rid. One per core (a new core starts afresh)."""

    def __init__(
        self,
        live: LiveRequests,
        waiting: WaitingQueue,
        batch: RunningSet,
        cache: PrefixCache,
        in_flight: InFlightSteps,
        rules: BatchingRules,
        async_scheduling: bool,
        clock: Callable[[], float],
    ) -> None:
        self._live = live
        self._waiting = waiting
        self._batch = batch
        self._cache = cache
        self._in_flight = in_flight
        self._rules = rules
        self._async = async_scheduling
        self._clock = clock
        self._held: list[list[Request]] = []  # the set-aside groups, next one first
        self._passed: set[str] = set()  # rids part of a completed step (not suspects)
        self._num_failed_steps: dict[str, int] = {}  # rid -> failed steps it was part of

    def bisect_failed_step(self, code: str, message: str) -> list[RequestOutput]:
        """The worker failed the oldest step in flight: the outputs of the requests the failure
        is pinned on (see the module docstring; the suspects are the requests of every step in
        flight: with overlap the next plan was built on the failed one); the others go back by
        recompute. Waiting requests (not in the steps) are untouched. The worker's batch needs a
        reset: the next plan resets it and sends every running request again. With overlap,
        blocks registered while the failed step was in flight may miss KV: the prefix cache is
        emptied. What the failed steps filled is never registered."""
        rids = [rid for flight in self._in_flight for rid in flight.rids]
        if len(self._in_flight) > 1 or self._async:
            self._cache.reset()
        else:  # what completed steps queued, before their requests' tables are dropped
            self._cache.flush()
        self._in_flight.clear()
        self._batch.forget_worker()
        step = []
        for rid in dict.fromkeys(rids):
            req = self._live.get(rid)
            if req is not None and req.status is RequestStatus.RUNNING:
                step.append(req)
        counts = self._num_failed_steps
        for req in step:
            counts[req.rid] = counts.get(req.rid, 0) + 1
        if len(step) == 1 or not self._rules.preempts_to_queue:
            pinned = step
        else:
            pinned = [r for r in step if counts[r.rid] >= MAX_FAILED_STEPS]
        outputs = self.fail_step([r.rid for r in pinned], code, message)
        rest = [r for r in step if r not in pinned]
        if rest:
            self._split(rest)
        return outputs

    def _split(self, rest: list[Request]) -> None:
        """The requests of a failed step not pinned: back by recompute, the first half of the
        suspects at the head of the queue, the second half held aside."""
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
            req.requeue()
        for req in first:
            self._waiting.add_preempted(req)
        if later:
            self._held.append(sorted(later, key=lambda r: r.seq_no))

    def step_completed(self, rids: Iterable[str]) -> None:
        """Called with the rids of each step whose result arrived: they are no suspects, and
        the next held group (if any) rejoins the head of the queue."""
        self._passed.update(rids)
        if len(self._passed) > 2 * len(self._live) + 64:  # forget finished rids now and then
            self._passed = {rid for rid in self._passed if rid in self._live}
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

    def check_invariants(self) -> None:
        """Raise AssertionError unless every held request is waiting, live, out of the queue
        and held once. Read-only."""
        held = [req for group in self._held for req in group]
        assert all(group for group in self._held), "an empty held group"
        assert len({id(r) for r in held}) == len(held), "a request held twice"
        for req in held:
            assert req.status is RequestStatus.WAITING and req.rid in self._live, req.rid
            assert req not in self._waiting, f"{req.rid} is held and queued"

    def remove_waiting(self, req: Request) -> None:
        """Take a waiting request out of the queue, or out of the held groups (it is aborted or
        fails)."""
        for group in self._held:
            if req in group:
                group.remove(req)
                self._held = [g for g in self._held if g]
                return
        self._waiting.remove(req)

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
                self.remove_waiting(req)
            else:
                self._batch.drop(req)
            self._live.finish(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
        return outputs


def requeue_after_loss(
    live_requests: list[Request],
    waiting: WaitingQueue,
    live: LiveRequests,
    max_retries: int,
    code: str,
    message: str,
    now: float,
) -> list[RequestOutput]:
    """`Scheduler.requeue_all`'s rule, once the parts are new: waiting requests keep their
    places, each running one recomputes from the queue's head unless it already restarted
    `max_retries` times (then it ends with `code`). Returns the error outputs."""
    outputs = []
    for req in live_requests:
        if req.status is RequestStatus.WAITING:
            waiting.add(req)
            continue
        req.reset_for_recompute()  # its table's pool is gone with the worker's KV
        req.forget_preemption()  # noted against the old core's versions
        if req.num_worker_retries >= max_retries:
            live.finish(req, "error", now)
            outputs.append(req.output([], [], "error", code, message))
            continue
        req.num_worker_retries += 1
        req.requeue()
        waiting.add_preempted(req)
    return outputs
