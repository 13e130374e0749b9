"""The live requests: every request admitted and not yet finished, by rid.

A request is live from `admit` (add_request) until `finish` (its one final output: stop,
length, abort or error); while live it is waiting (in the waiting queue, or held aside by the
bisection of a failed step) or running. This table is the one place a request becomes live and
stops being live; its `check_invariants` checks that every live request is in exactly one of
those places.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Optional

from services.scheduler.policy import WaitingQueue
from services.scheduler.request import Request, RequestStatus
from services.scheduler.running import RunningSet
from services.scheduler.stats import Counters
from services.scheduler.tracing import SchedulerTrace
from shared.protocol.engine_channel import SubmitRequest


class LiveRequests:
    def __init__(
        self,
        eos_token_ids: Iterable[int],
        max_len: int,
        counters: Counters,
        trace: Optional[SchedulerTrace] = None,
    ) -> None:
        """`max_len`: what max_model_len and the whole KV pool allow one request. `trace`:
        where a traced request's spans go when it finishes (None: tracing off)."""
        self._eos_ids = frozenset(eos_token_ids)
        self._trace = trace
        self._max_len = max_len
        self._counters = counters
        self._live: dict[str, Request] = {}
        self._seq_no = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._live.values()))

    def get(self, rid: str) -> Optional[Request]:
        return self._live.get(rid)

    def admit(self, req: SubmitRequest, now: float) -> Request:
        """Called by add_request once the admission checks passed: the new live request (the
        caller queues it). A resumption's earlier outputs follow its prompt: they count
        towards `max_tokens` and the penalties, and are computed as prefill."""
        stop_ids = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop_ids |= self._eos_ids
        self._seq_no += 1
        num_prompt = len(req.prompt_token_ids)
        max_len = min(self._max_len, num_prompt + req.sampling.max_tokens)
        if req.hand_over:  # a prefill engine's request ends at its first new token
            max_len = min(max_len, num_prompt + len(req.output_token_ids) + 1)
        request = Request(
            rid=req.rid,
            token_ids=[*req.prompt_token_ids, *req.output_token_ids],
            num_prompt_tokens=num_prompt,
            sampling=req.sampling,
            priority=req.priority,
            seq_no=self._seq_no,
            arrival_time=now,
            max_len=max_len,
            stop_ids=frozenset(stop_ids),
            traceparent=req.traceparent,
            hands_over=req.hand_over,
        )
        self._live[req.rid] = request
        return request

    def finish(
        self, req: Request, reason: str, now: float, kept_reason: Optional[str] = None
    ) -> None:
        """`req` stops being live (the caller sends its final output); counted by `reason`.
        `kept_reason`: a more precise one kept on the request for logs (an abort's cause). The
        caller took it out of the queue or the batch first (or keeps it as static padding)."""
        req.finish(kept_reason or reason, now)
        del self._live[req.rid]
        self._counters.count_finish(reason)
        if self._trace is not None and req.traceparent is not None:
            self._trace.finished(req)

    def check_invariants(
        self,
        waiting: WaitingQueue,
        batch: RunningSet,
        is_held: Callable[[Request], bool],
        num_held: int,
    ) -> None:
        """Raise AssertionError unless every live request is waiting (in the queue, or one of
        the `num_held` held aside by bisection: `is_held`, exactly one of the two) with nothing
        computed, or running in `batch`; and every running request but static padding is live.
        Read-only."""
        num_waiting = num_running = 0
        for req in self._live.values():
            if req.status is RequestStatus.WAITING:
                num_waiting += 1
                held = is_held(req)
                assert not req.block_ids and (req in waiting) != held, f"{req.rid} waits wrongly"
                # what a lookup's `attach` assumes of a request it starts (a miss changes nothing)
                assert req.num_computed_tokens == req.num_registered_blocks == 0, req.rid
            else:
                assert req.status is RequestStatus.RUNNING and req.rid in batch, f"{req.rid} lost"
                num_running += 1
        for req in batch.requests.values():
            assert req.padding or req.rid in self._live, f"{req.rid} runs but is not live"
        assert len(waiting) + num_held == num_waiting, "a request waits but is not live"
        assert num_running == sum(not r.padding for r in batch.requests.values()), "lost runner"
