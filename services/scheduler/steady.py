"""The steady-decode fast path, behind one object (`SteadyDecodes`): while the running batch does
not change, a step's decodes are the last step's and a result's tokens are appended without a
per-request check. It pays: same-run figures in docs/design/scheduler.md (about half of a
decode step at 256 and 1,024 running).

While no request joins, leaves, is preempted or loses the worker (`RunningSet.version`
unchanged) and every step computes every running request (one decode token each), each
request's `num_computed_tokens` grows by exactly one per built step. The two per-request checks
of a decode -- is its table full (grow it), is the sample in flight its last (skip it) -- then
first become due at a build count known in advance: `_Run.due` maps that count to the requests
to check, and every other request is neither read nor written until its turn. A check that
would change the list (a request waits) ends the run: the step falls back to the full pass.

The seam's four calls, in the order of a step:
* `fill(step, goes_on)`: the step filler (services/scheduler/fill.py), before its full pass;
  True when the step's decodes were filled from the run (the full pass is skipped);
* `after_full_pass(step, all_decode)`: after a full pass; a run starts after `STEADY_AFTER`
  passes in a row that scheduled every running request as a decode with the batch unchanged;
* `after_build(step, built) -> bool`: once the plan is built; whether its result may take the
  fast append (`InFlightStep.steady`);
* `apply(flight, result) -> ends or None`: the result path (services/scheduler/results.py), with
  every result; None sends it down the general path.
One read-only property besides: `covers_batch`, for a forward without decodes (a step
composition's prefill forward, services/scheduler/composition.py), which then need not look for
running prefills.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from services.scheduler.inflight import InFlightStep
from services.scheduler.request import Request
from services.scheduler.running import RunningSet
from services.scheduler.step import BuiltStep, StepBuilder
from shared.protocol.worker_channel import StepResult

# full passes in a row, all decodes with the batch unchanged, before a steady run starts
# (starting one costs a pass over the batch: a batch that changes every few steps never pays it)
STEADY_AFTER = 4


class SteadyDecodes:
    """One per running set. `enabled` False (static batching, whose finished members stay as
    padding and are computed) never starts a run and never marks a step steady."""

    def __init__(self, batch: RunningSet, block_size: int, enabled: bool = True) -> None:
        self._batch = batch
        self._block_size = block_size
        self._enabled = enabled
        self._run: Optional[_Run] = None  # the steady run of decodes, if any
        # (batch version, full passes in a row at it that scheduled every request as a decode)
        self._streak: tuple[Optional[int], int] = (None, 0)
        self._tokens: Optional[_Tokens] = None  # the result side
        # since start (tests check that the fast paths run): steps whose decodes a run filled,
        # and results appended in C
        self.num_reused_steps = 0
        self.num_fast_results = 0

    @property
    def is_running(self) -> bool:
        """A steady run is on (the next step may reuse the last one's decodes)."""
        return self._run is not None

    @property
    def covers_batch(self) -> bool:
        """A run holds the batch unchanged: every running request decodes (none in prefill).
        Read by the step filler before a forward without decodes."""
        run = self._run
        return run is not None and run.version == self._batch.version

    def fill(self, step: StepBuilder, goes_on: Callable[[Request, StepBuilder], bool]) -> bool:
        """The run's step: the last step's decodes again, after `goes_on` checked the requests
        due. False (nothing scheduled, the run over) when it cannot be reused: the batch
        changed, or a check says a request does not compute this step."""
        run = self._run
        if run is None:
            return False
        version = self._batch.version
        if not run.armed or run.version != version:
            self._run = None
            return False
        build, due = run.take_due()
        for req in due:
            if not goes_on(req, step) or self._batch.version != version:
                self._run = None  # a request waits or was preempted: the full pass
                return False
            run.check_later(req, build)
        step.reuse_decodes(run.decodes, run.rids, due)
        self.num_reused_steps += 1
        return True

    def after_full_pass(self, step: StepBuilder, all_decode: bool) -> None:
        """After a full pass: count it towards a run (see `STEADY_AFTER`)."""
        version = self._batch.version
        all_decode = all_decode and len(step.decodes) == len(self._batch)
        if not all_decode or not self._enabled:
            self._streak = (None, 0)
        elif self._streak[0] != version:
            self._streak = (version, 1)
        elif self._streak[1] + 1 < STEADY_AFTER:
            self._streak = (version, self._streak[1] + 1)
        else:
            self._streak = (None, 0)
            self._run = _Run.start(step.decodes, version, self._block_size)

    def after_build(self, step: StepBuilder, built: BuiltStep) -> bool:
        """The step was built: it continues the run if it computed the whole list with the batch
        unchanged (a later preemption in the step, or an admission, ends the run). Returns
        whether the step's result may take the fast path (every held request decodes, none is
        new)."""
        run = self._run
        if step.drafts:  # speculation: computed counts move by the accepted drafts
            self._run, self._streak = None, (None, 0)
        elif run is not None:
            if run.version == self._batch.version and len(step.decodes) == len(run.decodes):
                run.built()
            else:
                self._run = None
        return self._enabled and built.steady and not built.plan.new_seqs

    def apply(self, flight: InFlightStep, result: StepResult) -> Optional[list[int]]:
        """Called with every result whose token count fits: for a steady step with the batch
        unchanged since it was built, append each token (every request runs, has sampled before
        and is not protected) and return the indices of the requests that end (a stop id or
        the length limit: the caller finishes them). Else None: the general path appends."""
        if not flight.steady or flight.version != self._batch.version:
            self._tokens = None  # tokens appended outside it
            return None
        sampled = flight.sampled
        fast = self._tokens
        if fast is None or fast.sampled is not sampled:
            fast = self._tokens = _Tokens.of(sampled)
        if fast.append_if_none_ends(result.token_ids):
            self.num_fast_results += 1
            return []
        self._tokens = None  # some request ends: its list changes
        ends: list[int] = []
        for i, (req, token) in enumerate(zip(sampled, result.token_ids, strict=True)):
            tokens = req.token_ids
            tokens.append(token)
            if token in req.stop_ids or len(tokens) >= req.max_len:
                ends.append(i)
        return ends

    def forget_tokens(self) -> None:
        """Tokens are appended outside `apply` (a step with drafts): the result side is
        rebuilt at the next steady result."""
        self._tokens = None

    def check_invariants(self) -> None:
        """Raise AssertionError unless a run whose batch is unchanged holds exactly the running
        requests, in batch order, each filed once for a later check. Read-only."""
        run = self._run
        if run is None or run.version != self._batch.version:
            return  # no run, or one the next step ends
        assert [r.rid for r in run.decodes] == list(self._batch.requests), "steady run: stale"
        assert run.rids == [r.rid for r in run.decodes], "steady run: rids"
        filed = [r.rid for bucket in run.due.values() for r in bucket]
        assert sorted(filed) == sorted(run.rids), "steady run: a request not filed once"


@dataclass(slots=True)
class _Run:
    decodes: list[Request]  # every running request, in batch order; read-only
    rids: list[str]  # their rids (the step record's list); read-only
    version: int  # `RunningSet.version` when it was made
    block_size: int
    num_builds: int = 0  # steps built since, each computing every one of `decodes`
    armed: bool = False  # the last step built was one of them: the next may reuse the list
    due: dict[int, list[Request]] = field(default_factory=dict)  # build number -> to check

    @classmethod
    def start(cls, decodes: list[Request], version: int, block_size: int) -> _Run:
        """Made by a full pass that scheduled every running request as a decode (before the
        step is built: the next build is number 1)."""
        run = cls(list(decodes), [r.rid for r in decodes], version, block_size)
        for req in decodes:
            run.check_later(req, 1)
        return run

    def check_later(self, req: Request, build: int) -> None:
        """`req` was checked for build number `build` (its computed count as of now, before
        that build): file it under the first later build at which a check may say otherwise.
        Its computed count at build b is the present one plus b - build."""
        computed = req.num_computed_tokens
        to_boundary = len(req.block_ids) * self.block_size - computed  # >= 1 once checked
        to_last = req.max_len - 1 - computed  # computed + 1 >= max_len from here on
        at = build + max(1, min(to_boundary, to_last))
        bucket = self.due.get(at)
        if bucket is None:
            self.due[at] = [req]
        else:
            bucket.append(req)

    def take_due(self) -> tuple[int, list[Request]]:
        """The next build's number and the requests to check for it. Disarms: only a built
        step that computed the whole list re-arms it (`built`)."""
        self.armed = False
        build = self.num_builds + 1
        return build, self.due.pop(build, [])

    def built(self) -> None:
        """The step just built computed every request of the list."""
        self.num_builds += 1
        self.armed = True


@dataclass(slots=True)
class _Tokens:
    """The result side of a run: results of steady steps over one unchanged list of samplers
    (`sampled`, the worker view's shared list), each appending one token to every one of them.
    While no token can end a request -- none is a stop id of any of them, and every request has
    more than one token left before its length limit -- a result is appended in C
    (`list.append` mapped over the token lists), with no per-request check in Python. Valid
    only while every token the samplers get comes through `SteadyDecodes.apply`."""

    sampled: list[Request]  # the list it was made for: compared by identity
    token_lists: list[list[int]]  # each sampler's token_ids (the same list objects)
    stop_ids: frozenset[int]  # every sampler's stop ids together
    min_left: int  # the fewest tokens any sampler may still append before its length limit

    @classmethod
    def of(cls, sampled: list[Request]) -> _Tokens:
        token_lists = [r.token_ids for r in sampled]
        stop_ids = frozenset().union(*(r.stop_ids for r in sampled))
        min_left = min((r.max_len - len(r.token_ids) for r in sampled), default=0)
        return cls(sampled, token_lists, stop_ids, min_left)

    def append_if_none_ends(self, token_ids: list[int]) -> bool:
        """Append one result's tokens (one per sampler, in order) when none of them can end its
        request; False (nothing appended) otherwise."""
        if self.min_left <= 1 or not self.stop_ids.isdisjoint(token_ids):
            return False
        deque(map(list.append, self.token_lists, token_ids), maxlen=0)
        self.min_left -= 1
        return True
