"""The worker's step spans (shared/tracing.py): one `worker.step` span per step rank 0 answers,
from the plan's arrival to its result's departure, linking the request (the frontend's request
span, its sequence's `traceparent`) of every sequence the step computed. A step serves many
requests, so it is a trace of its own; each request's trace reaches it through the link.

Plans name sequences by slot: the slot -> span context map they imply is kept here (each
traceparent is parsed once, when its sequence joins). Built only when tracing is on.
"""

from __future__ import annotations

import time
from typing import Any

from shared.protocol.worker_channel import StepPlan, StepResult
from shared.tracing import Tracing


class StepTrace:
    """Called by the worker loop: `on_plan` for each plan before it runs, `on_result` for each
    result sent. Invariant: `_links` holds the held sequences that were traced, by slot."""

    def __init__(self, tracing: Tracing) -> None:
        from opentelemetry import trace

        self._tracing = tracing
        self._link = trace.Link
        self._links: dict[int, Any] = {}  # slot -> the request's SpanContext
        self._open: dict[int, tuple[int, list[Any], StepPlan]] = {}  # step_id -> start, links

    def on_plan(self, plan: StepPlan) -> None:
        if plan.prev_step_id is None:
            self._links.clear()
        for slot in plan.released_slots:
            self._links.pop(slot, None)
        for seq in plan.new_seqs:
            if seq.traceparent is not None:
                ctx = self._tracing.span_context(seq.traceparent)
                if ctx is not None:
                    self._links[seq.slot] = ctx
        waits = {s for s, n in zip(plan.count_slots, plan.counts, strict=True) if n == 0}
        links = [self._link(c) for s, c in self._links.items() if s not in waits]
        self._open[plan.step_id] = (time.time_ns(), links, plan)

    def on_result(self, result: StepResult) -> None:
        opened = self._open.pop(result.step_id, None)
        if opened is None:
            return
        start, links, plan = opened
        attrs = {"conveyor.step_id": plan.step_id, "conveyor.num_seqs": plan.num_seqs,
                 "conveyor.num_scheduled_tokens": plan.num_scheduled_tokens,
                 "conveyor.num_sampled": len(result.token_ids),
                 "conveyor.forward_s": result.forward_s}  # fmt: skip
        span = self._tracing.tracer.start_span(
            "worker.step", attributes=attrs, links=links, start_time=start
        )
        span.end()

    def on_failure(self, step_id: int) -> None:
        """A step that failed has no span."""
        self._open.pop(step_id, None)
