"""The scheduler's result path: a step's sampled tokens in, outputs and finished requests out.

A part of `Scheduler` (services/scheduler/scheduler.py), kept in its own module because it is
its own concern: `update()` runs between a result and the next plan, so it is the code that
must stay cheap per running request. The methods run on the scheduler's state and keep the same
invariants (services/scheduler/integrity.py) after every call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from services.scheduler.request import Request, RequestStatus
from services.scheduler.steady import SteadyTokens
from services.scheduler.step import StepBuilder
from shared.protocol.engine_channel import OutputBatch, RequestOutput
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import StepResult, TokenLogprobs

RUNNING = RequestStatus.RUNNING


class StepResults:
    """Mixed into Scheduler; uses its `_inflight`, `_batch`, `_live`, `_clock`, `_rules`,
    `_caching`, `prefix_cache`, `block_size` and `counters`."""

    _steady_tokens: Optional[SteadyTokens]  # the steady run's fast append, if any (steady.py)

    # ---- results -----------------------------------------------------------------------------

    def update(self, result: StepResult) -> OutputBatch:
        """Called with the in-flight plan's result: append sampled tokens, finish requests
        (stop token, max_tokens, max_model_len) and free their blocks. Tokens of requests that
        are no longer live (aborted while the plan was in flight) are ignored.

        The result names no rids: its i-th token is the sample of the i-th sequence that
        sampled, in the worker's batch order, which the scheduler kept (`InFlightStep.sampled`,
        services/scheduler/worker_view.py). A result with another number of tokens breaks the
        contract: every request that sampled in that step fails (the worker is not trusted to
        have sampled for the right one).

        Returns the step's outputs for every frontend, columnar (this loop is on the path
        between a result and the next plan: a request that goes on costs no allocation). Its
        `logprobs` are the result's, possibly with entries of finished or ignored rids; the
        server keeps each frontend's own when it splits the batch.
        """
        if not self._inflight or result.step_id != self._inflight[0].step_id:
            expected = self._inflight[0].step_id if self._inflight else None
            raise ValueError(f"result for step {result.step_id} but step {expected} is next")
        flight = self._inflight.popleft()
        if flight.filled:  # the step completed: its chunks' blocks are registered off the path
            self.prefix_cache.filled.extend(flight.filled)
        now = self._clock()
        if len(result.token_ids) != len(flight.sampled):
            message = (f"the worker returned {len(result.token_ids)} tokens for "
                       f"{len(flight.sampled)} sequences that sampled")  # fmt: skip
            self._steady_tokens = None
            failed = self._fail_missing(flight.sampled, now, message)
            return OutputBatch(result.step_id, finished=failed)
        if flight.steady_mark == self._batch.num_changes:
            ended, ends = self._apply_steady(flight.sampled, result, now)
            return self._output_batch(result, flight.sampled_rids, ends, ended)
        self._steady_tokens = None  # tokens appended outside it
        running = RUNNING
        finished: list[RequestOutput] = []
        skipped: list[int] = []  # result entries that are not a going-on token (rare)
        for i, (req, token) in enumerate(zip(flight.sampled, result.token_ids, strict=True)):
            # A sample lands at len(token_ids) while the request has computed that far (with a
            # plan in flight behind this one, one further) and was not preempted since the plan
            # was built (inflight.py): else it is recomputed.
            preempted = req.preempted_at_version
            if req.num_computed_tokens >= len(req.token_ids) and (
                preempted is None or preempted <= flight.version
            ):
                tokens = req.token_ids
                if req.status is running:
                    tokens.append(token)
                    if req.first_token is None:
                        req.first_token = now
                        req.protected = False
                    elif req.protected:
                        req.protected = False
                    if token not in req.stop_ids and len(tokens) < req.max_len:
                        continue  # the common case: it goes on, and stays in the columns
                    finished.append(self._finish_with(req, token, result.logprobs, now))
                elif req.padding:  # static batching computes finished members
                    tokens.append(token)
                # else: aborted (or finished: overlap's extra step) while the plan was in flight
            skipped.append(i)
        return self._output_batch(result, flight.sampled_rids, skipped, finished)

    def _apply_steady(
        self, sampled: list[Request], result: StepResult, now: float
    ) -> tuple[list[RequestOutput], list[int]]:
        """`update` for a steady plan with no request finished, aborted or preempted since it
        was built (`InFlightStep.steady_mark`): each request runs, has its first token and is
        not protected, so a token costs an append and the two finish checks, or, while no token
        can end a request (steady.py `SteadyTokens`), only the append. Returns the final
        outputs and their indices in the result."""
        fast = self._steady_tokens
        if fast is None or fast.sampled is not sampled:
            fast = self._steady_tokens = SteadyTokens.of(sampled)
        if fast.append_if_none_ends(result.token_ids):
            return [], []
        self._steady_tokens = None  # some request ends: its list changes
        ends: list[int] = []
        for i, (req, token) in enumerate(zip(sampled, result.token_ids, strict=True)):
            tokens = req.token_ids
            tokens.append(token)
            if token in req.stop_ids or len(tokens) >= req.max_len:
                ends.append(i)
        finished = [self._finish_with(sampled[i], result.token_ids[i], result.logprobs, now)
                    for i in ends]  # fmt: skip
        return finished, ends

    def _output_batch(
        self,
        result: StepResult,
        rids: list[str],
        skipped: list[int],
        finished: list[RequestOutput],
    ) -> OutputBatch:
        """The step's outputs: the result's tokens with the `rids` of the sequences that
        sampled, minus the `skipped` entries."""
        token_ids = result.token_ids  # read-only lists: shared, not copied
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

    def _fail_missing(
        self, sampled: Iterable[Request], now: float, message: str
    ) -> list[RequestOutput]:
        """The worker's result does not fit the sequences that sampled: a worker bug. End
        those requests with an error rather than leave them waiting for a token forever."""
        outputs = []
        for req in list(sampled):
            if req.num_computed_tokens < len(req.token_ids):
                continue  # preempted since
            if req.padding and req.rid in self._batch:
                self._batch.preempt(req, StepBuilder(0))  # evict: it only holds its slot now
            elif req.status is RUNNING:
                self._batch.drop(req)
                self._mark_finished(req, "error", now)
                outputs.append(req.output([], [], "error", ErrorCode.WORKER_FAILED, message))
        return outputs
