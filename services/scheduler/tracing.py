"""The scheduler's spans of a traced request (shared/tracing.py), built when it finishes.

Under the frontend's request span (the request's `traceparent`): `scheduler.request` from
arrival to finish, with `scheduler.waiting` (arrival -> first scheduled) and
`scheduler.running` (first scheduled -> finished) under it; events mark when it was admitted,
each preemption (on the running span: it went back to wait and recomputed) and its finish.
Nothing is done per step: the request keeps its times (and, traced, its preemption times),
`LiveRequests.finish` hands it here once (a list append), and its spans are built in
`Scheduler.after_plan`, off the result -> plan path (built there, on the path, they cost ~7% of
a mixed step at 256 running: docs/PERFORMANCE.md §13).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.tracing import Tracing

if TYPE_CHECKING:
    from services.scheduler.request import Request


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class SchedulerTrace:
    """Emits a finished traced request's spans (the scheduler clock is time.time())."""

    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing
        self._finished: list[Request] = []  # finished, spans not built yet

    def finished(self, req: Request) -> None:
        """Called once by LiveRequests.finish for a request with a traceparent (finished: its
        fields no longer change)."""
        self._finished.append(req)

    def flush(self) -> None:
        """Build the spans of the requests finished since the last call (Scheduler.after_plan,
        while the worker computes)."""
        if self._finished:
            done, self._finished = self._finished, []
            for req in done:
                self._spans(req)

    def _spans(self, req: Request) -> None:
        t = self._tracing
        end = req.finished if req.finished is not None else req.arrival_time
        attrs = {"conveyor.rid": req.rid, "conveyor.num_prompt_tokens": req.num_prompt_tokens,
                 "conveyor.num_preemptions": req.num_preemptions,
                 "conveyor.finish_reason": req.finish_reason or ""}  # fmt: skip
        span = t.start("scheduler.request", req.traceparent, _ns(req.arrival_time), attrs)
        admitted = req.first_scheduled
        t.child("scheduler.waiting", span, _ns(req.arrival_time), _ns(admitted or end),
                **{"conveyor.rid": req.rid})  # fmt: skip
        if admitted is not None:
            span.add_event("admitted", timestamp=_ns(admitted))
            running = t.tracer.start_span(
                "scheduler.running",
                context=_in(span),
                attributes={"conveyor.rid": req.rid},
                start_time=_ns(admitted),
            )
            for when in req.preempted_times or ():
                running.add_event("preempted", timestamp=_ns(when))
            running.end(end_time=_ns(end))
        span.add_event("finished", {"reason": req.finish_reason or ""}, timestamp=_ns(end))
        span.end(end_time=_ns(end))


def _in(span: object) -> object:
    from opentelemetry import trace

    return trace.set_span_in_context(span)  # type: ignore[arg-type]
