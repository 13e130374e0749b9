"""The scheduler's result path: a step's sampled tokens in, outputs and finished requests out.

A part of `Scheduler` (services/scheduler/scheduler.py), kept in its own module because it is
its own concern: `update()` runs between a result and the next plan, so it is the code that
must stay cheap per running request. The methods run on the scheduler's state and keep the same
invariants (services/scheduler/integrity.py) after every call.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import StepBuilder
from shared.protocol.engine_channel import OutputBatch, RequestOutput
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import StepResult, TokenLogprobs

RUNNING = RequestStatus.RUNNING


class StepResults:
    """Mixed into Scheduler; uses its `_inflight`, `_batch`, `_live`, `_clock`, `_rules`,
    `_caching`, `prefix_cache`, `block_size` and `counters`."""

    # ---- results -----------------------------------------------------------------------------

    def update(self, result: StepResult) -> OutputBatch:
        """Called with the in-flight plan's result: append sampled tokens, finish requests
        (stop token, max_tokens, max_model_len) and free their blocks. Tokens of requests that
        are no longer live (aborted while the plan was in flight) are ignored.

        Returns the step's outputs for every frontend, columnar (this loop is on the path
        between a result and the next plan: a request that goes on costs no allocation). Its
        `logprobs` are the result's, possibly with entries of finished or ignored rids; the
        server keeps each frontend's own when it splits the batch.
        """
        if not self._inflight or result.step_id != self._inflight[0].step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ValueError(f"result for step {result.step_id} but step {expected} is next")
        if len(result.rids) != len(result.token_ids):
            raise ValueError("step result rids and token_ids differ in length")
        flight = self._inflight.popleft()
        if flight.filled:  # the step completed: the blocks its chunks filled are valid
            self._register_filled(flight.filled)
        inflight = flight.sampled  # entries are taken out as tokens arrive: a dup finds none
        now = self._clock()
        running = RUNNING
        finished: list[RequestOutput] = []
        skipped: list[int] = []  # result entries that are not a going-on token (rare)
        for i, (rid, token) in enumerate(zip(result.rids, result.token_ids, strict=True)):
            req = inflight.pop(rid, None)  # None: not sampled in this plan, or a dup
            # A sample lands at len(token_ids) while the request has computed that far (with a
            # plan in flight behind this one, one further): else it was preempted meanwhile.
            if req is not None and req.num_computed_tokens >= len(req.token_ids):
                tokens = req.token_ids
                if req.status is running:
                    tokens.append(token)
                    req.protected = False
                    if req.first_token is None:
                        req.first_token = now
                    if token not in req.stop_ids and len(tokens) < req.max_len:
                        continue  # the common case: it goes on, and stays in the columns
                    finished.append(self._finish_with(req, token, result.logprobs, now))
                elif req.padding:  # static batching computes finished members
                    tokens.append(token)
                # else: aborted (or finished: overlap's extra step) while the plan was in flight
            skipped.append(i)
        if inflight:  # sampling requests the result has no token for
            finished.extend(self._fail_missing(inflight.values(), now))
        return self._output_batch(result, skipped, finished)

    def _register_filled(self, filled: list[Request]) -> None:
        """Prefix caching: blocks filled by the completed step's prefill chunks are queued for
        registration (requests aborted while it ran are skipped: their blocks are free)."""
        batch, bs, defer = self._batch, self.block_size, self.prefix_cache.defer
        for req in filled:
            if req.rid in batch and batch.requests[req.rid] is req:
                defer(req, min(req.num_computed_tokens // bs, len(req.block_ids)))

    def _output_batch(
        self, result: StepResult, skipped: list[int], finished: list[RequestOutput]
    ) -> OutputBatch:
        """The step's outputs: the result's columns minus the `skipped` entries."""
        rids, token_ids = result.rids, result.token_ids  # read-only lists: shared, not copied
        if skipped:
            drop = set(skipped)
            rids = [r for i, r in enumerate(rids) if i not in drop]
            token_ids = [t for i, t in enumerate(token_ids) if i not in drop]
        self.counters.num_output_tokens += len(rids) + sum(len(o.new_token_ids) for o in finished)
        # the result's logprobs as they are: the server cuts them per frontend (off this path)
        return OutputBatch(result.step_id, rids, token_ids, result.logprobs, finished)

    def _finish_with(
        self, req: Request, token: int, logprobs: dict[str, TokenLogprobs], now: float
    ) -> RequestOutput:
        """`req` sampled its last token: finish it; its final output."""
        reason = "stop" if token in req.stop_ids else "length"
        self._finish(req, reason, now)
        lps = [logprobs[req.rid]] if req.rid in logprobs else []
        return req.output([token], lps, reason)

    def _finish(self, req: Request, reason: str, now: float) -> None:
        self._mark_finished(req, reason, now)
        if self._rules.keeps_finished_as_padding:
            if self._caching:  # its last step completed: what it computed stays findable
                self.prefix_cache.register_computed(req)
            req.padding = True  # keeps its slot and blocks until the whole batch is done
        else:
            if self._caching:  # its blocks are registered and freed by after_plan()
                self.prefix_cache.hold(req)  # takes them: drop() frees none
            self._batch.drop(req)

    def _mark_finished(self, req: Request, reason: str, now: float) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished = now
        del self._live[req.rid]
        self.counters.count_finish(reason)

    def _fail_missing(self, sampled: Iterable[Request], now: float) -> list[RequestOutput]:
        """The worker returned no token for a sequence that sampled: a worker bug. End those
        requests with an error rather than leave them waiting for a token forever."""
        outputs = []
        for req in list(sampled):
            if req.num_computed_tokens < len(req.token_ids):
                continue  # preempted since
            if req.padding and req.rid in self._batch:
                self._batch.preempt(req, StepBuilder(0))  # evict: it only holds its slot now
            elif req.status is RUNNING:
                self._batch.drop(req)
                self._mark_finished(req, "error", now)
                message = "the worker returned no token"
                outputs.append(req.output([], [], "error", ErrorCode.WORKER_FAILED, message))
        return outputs
