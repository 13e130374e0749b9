"""The scheduler's result path: a step's sampled tokens in, outputs and finished requests out.

`ResultApplier.update()` runs between a result and the next plan, so it is the code that must
stay cheap per running request. It takes the oldest step of the in-flight record, appends each
sample to its request (through the steady seam when the batch is unchanged,
services/scheduler/steady.py), finishes requests (stop token, max_tokens, max_model_len) and
frees their blocks; the scheduler's invariants hold after every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Optional

from services.scheduler.batching import BatchingRules
from services.scheduler.handover import Leases
from services.scheduler.inflight import InFlightStep, InFlightSteps
from services.scheduler.live import LiveRequests
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request, RequestStatus
from services.scheduler.running import RunningSet
from services.scheduler.speculation import NO_DRAFTS, SpecContractError, Speculation
from services.scheduler.stats import Counters
from services.scheduler.steady import SteadyDecodes
from services.scheduler.step import StepBuilder
from shared.protocol.engine_channel import OutputBatch, RequestOutput
from shared.protocol.errors import ErrorCode
from shared.protocol.worker_channel import StepResult, TokenLogprobs

RUNNING = RequestStatus.RUNNING


class ResultApplier:
    def __init__(
        self,
        live: LiveRequests,
        batch: RunningSet,
        cache: PrefixCache,
        in_flight: InFlightSteps,
        steady: SteadyDecodes,
        rules: BatchingRules,
        counters: Counters,
        clock: Callable[[], float],
        leases: Leases,
        speculation: Optional[Speculation] = None,
    ) -> None:
        """`leases`: a prefill engine's hand-overs (handover.py). `speculation`: applies the
        accepted drafts of steps that gave draft limits."""
        self._leases = leases
        self._live = live
        self._batch = batch
        self._cache = cache
        self._caching = cache.enabled
        self._in_flight = in_flight
        self._steady = steady
        self._padding = rules.keeps_finished_as_padding
        self._counters = counters
        self._clock = clock
        self._speculation = speculation

    def update(self, result: StepResult) -> OutputBatch:
        """Called with the oldest in-flight plan's result: append sampled tokens, finish
        requests and free their blocks. Tokens of requests that are no longer live (aborted
        while the plan was in flight) are ignored.

        The result names no rids: its i-th token is the sample of the i-th sequence that
        sampled, in the worker's batch order, which the scheduler kept (`InFlightStep.sampled`,
        services/scheduler/worker_view.py). A result with another number of tokens breaks the
        contract: every request that sampled in that step fails (the worker is not trusted to
        have sampled for the right one).

        Returns the step's outputs for every frontend, columnar (a request that goes on costs
        no allocation). Its `logprobs` are the result's, possibly with entries of finished or
        ignored rids; the server keeps each frontend's own when it splits the batch.
        """
        flight = self._in_flight.take(result.step_id)
        if flight.filled:  # the step completed: its chunks' blocks are registered off the path
            self._cache.queue_filled(flight.filled)
        now = self._clock()
        if len(result.token_ids) != len(flight.sampled):
            message = (f"the worker returned {len(result.token_ids)} tokens for "
                       f"{len(flight.sampled)} sequences that sampled")  # fmt: skip
            failed = self._fail_missing(flight.sampled, now, message)
            return OutputBatch(result.step_id, finished=failed)
        if flight.drafts or result.drafts is not None:
            return self._apply_drafted(flight, result, now)
        ends = self._steady.apply(flight, result)
        if ends is None:
            return self._apply_each(flight, result, now)
        finished: list[RequestOutput] = []
        for i in ends:  # rare: the common steady result ends nobody
            req = flight.sampled[i]
            finished.append(self._finish_with(req, [result.token_ids[i]], result, now))
        return self._output_batch(result, flight.sampled_rids, ends, finished)

    def _apply_drafted(self, flight: InFlightStep, result: StepResult, now: float) -> OutputBatch:
        """A step that gave draft limits (speculation.py): the counts move, then each row's
        accepted drafts come before its token. Columns that do not fit the limits break the
        contract like a wrong token count."""
        self._steady.forget_tokens()
        try:
            if self._speculation is None:
                raise SpecContractError("a result with drafts from a step that gave none")
            drafted = self._speculation.settle(flight, result)
        except SpecContractError as exc:
            failed = self._fail_missing(flight.sampled, now, str(exc))
            return OutputBatch(result.step_id, finished=failed)
        finished: list[RequestOutput] = []
        multi: list[RequestOutput] = []  # the tokens of requests that go on, as outputs
        for i, (req, token) in enumerate(zip(flight.sampled, result.token_ids, strict=True)):
            preempted = req.preempted_at_version  # it lands as in `_apply_each`
            if req.num_computed_tokens >= len(req.token_ids) and (
                preempted is None or preempted <= flight.version
            ):
                if req.status is RUNNING:  # (static batching never drafts: no padding here)
                    drafts = drafted.get(i, NO_DRAFTS)
                    lps = drafts.logprobs + _logprobs_of(req, result)
                    new_tokens = drafts.token_ids + [token]
                    self._apply_several(req, new_tokens, lps, result, now, multi, finished)
        skipped = list(range(len(flight.sampled)))  # a small batch: no columns
        return self._output_batch(result, flight.sampled_rids, skipped, finished, multi)

    def _apply_each(self, flight: InFlightStep, result: StepResult, now: float) -> OutputBatch:
        """The general path: each sample checked against its request."""
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
                    if req.protected or req.first_token is None:
                        req.note_sampled(now)
                    if token not in req.stop_ids and len(tokens) < req.max_len:
                        continue  # the common case: it goes on, and stays in the columns
                    finished.append(self._finish_with(req, [token], result, now))
                elif req.padding:  # static batching computes finished members
                    tokens.append(token)
                # else: aborted (or finished: overlap's extra step) while the plan was in flight
            skipped.append(i)
        return self._output_batch(result, flight.sampled_rids, skipped, finished)

    def _apply_several(
        self,
        req: Request,
        new_tokens: list[int],
        lps: list[TokenLogprobs],
        result: StepResult,
        now: float,
        multi: list[RequestOutput],
        finished: list[RequestOutput],
    ) -> None:
        """A running request's accepted drafts and its token, in order, up to the first that
        ends it (a stop id or the length limit; the rest are dropped). `lps`: one per token of
        `new_tokens`, or none (not asked)."""
        tokens = req.token_ids
        if req.protected or req.first_token is None:
            req.note_sampled(now)
        for j, token in enumerate(new_tokens):
            tokens.append(token)
            if token in req.stop_ids or len(tokens) >= req.max_len:
                out = self._finish_with(req, new_tokens[: j + 1], result, now, lps[: j + 1])
                finished.append(out)
                return
        multi.append(req.output(new_tokens, lps))

    def _output_batch(
        self,
        result: StepResult,
        rids: list[str],
        skipped: list[int],
        finished: list[RequestOutput],
        multi: Optional[list[RequestOutput]] = None,
    ) -> OutputBatch:
        """The step's outputs: the result's tokens with the `rids` of the sequences that
        sampled, minus the `skipped` entries."""
        token_ids = result.token_ids  # read-only lists: shared, not copied
        if skipped:
            drop = set(skipped)
            rids = [r for i, r in enumerate(rids) if i not in drop]
            token_ids = [t for i, t in enumerate(token_ids) if i not in drop]
        num_outputs = len(rids)
        multi = multi or []
        for out in (*finished, *multi):
            num_outputs += len(out.new_token_ids)
        self._counters.num_output_tokens += num_outputs
        # the result's logprobs as they are: the server cuts them per frontend (off this path)
        return OutputBatch(result.step_id, rids, token_ids, result.logprobs, finished, multi)

    def _finish_with(
        self,
        req: Request,
        new_tokens: list[int],
        result: StepResult,
        now: float,
        lps: Optional[list[TokenLogprobs]] = None,
    ) -> RequestOutput:
        """`req` sampled its last token (`new_tokens[-1]`, after any accepted drafts): finish
        it; its final output (with its embedding, an embedding request's, from the result).
        `lps`: the logprobs of `new_tokens` (None: the result's, for its one token)."""
        reason = "stop" if new_tokens[-1] in req.stop_ids else "length"
        if reason == "length" and req.hands_over and _short_of_max_tokens(req):
            reason = "handover"  # a prefill engine's request: its decode engine goes on
        self._live.finish(req, reason, now)
        if self._caching:  # what it computed stays findable once its blocks are freed
            self._cache.register_computed(req)
        handover = self._leases.grant(req) if reason == "handover" else None
        if self._padding:
            req.padding = True  # keeps its slot and blocks until the whole batch is done
        else:
            self._batch.drop(req)
        if lps is None:
            lps = _logprobs_of(req, result)
        out = req.output(new_tokens, lps, reason)
        if handover is not None:
            out = dataclasses.replace(out, handover=handover)
        if result.embeddings and req.rid in result.embeddings:
            return dataclasses.replace(out, embedding=result.embeddings[req.rid])
        return out

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
                self._live.finish(req, "error", now)
                outputs.append(req.output([], [], "error", ErrorCode.WORKER_FAILED, message))
        return outputs


def _logprobs_of(req: Request, result: StepResult) -> list[TokenLogprobs]:
    """`req`'s logprobs of its token in `result` (none when it did not ask)."""
    return [result.logprobs[req.rid]] if req.rid in result.logprobs else []


def _short_of_max_tokens(req: Request) -> bool:
    """Whether `req` may still generate (its own max_tokens and max_model_len allow more)."""
    num_outputs = len(req.token_ids) - req.num_prompt_tokens
    return num_outputs < req.sampling.max_tokens
