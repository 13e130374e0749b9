"""The frontend's spans of a traced request (shared/tracing.py).

`frontend.request` opens when the `generate` (or `embed`) arrives, under the client's
`traceparent` when it sent one (the gateway does), and its own traceparent travels to the
scheduler in SubmitRequest. When the request closes (RequestFlow.close), its children are
built from the times the request keeps anyway: `frontend.tokenize` (arrival -> submitted to an
engine: template, tokenization, admission checks), `frontend.queue` (submitted -> first token:
the engine's waiting and prefill), `frontend.stream` (first token -> last token) and
`frontend.detokenize` (the final output's detokenization, stop strings and reply frames: for a
request not streamed, all of its detokenization).
"""

from __future__ import annotations

import time
from typing import Optional

from shared.tracing import Tracing


class RequestTrace:
    """One traced request's frontend spans; owned by its ClientRequest (`trace`)."""

    def __init__(
        self, tracing: Tracing, parent: Optional[str], received_at: float, client_id: str
    ) -> None:
        from opentelemetry.trace import SpanKind

        self._tracing = tracing
        self._received_at = received_at  # time.monotonic()
        self.submitted_at = received_at
        self._detokenize: Optional[tuple[float, float]] = None
        attrs = {"conveyor.client_id": client_id}
        start = tracing.wall_ns(received_at)
        self.span = tracing.start("frontend.request", parent, start, attrs, kind=SpanKind.SERVER)
        self.traceparent = tracing.traceparent(self.span)

    def submitted(self, rid: str) -> None:
        """The request got its rid and was sent to an engine (tokenization is over)."""
        self.submitted_at = time.monotonic()
        self.span.set_attribute("conveyor.rid", rid)

    def detokenized(self, start: float, end: float) -> None:
        """The output path handled the final output between these monotonic times."""
        self._detokenize = (start, end)

    def end(self, first_token_at: Optional[float], last_token_at: Optional[float]) -> None:
        """The request closed (whichever way): its children, then its span."""
        t, w, span = self._tracing, self._tracing.wall_ns, self.span
        now = time.monotonic()
        t.child("frontend.tokenize", span, w(self._received_at), w(self.submitted_at))
        t.child("frontend.queue", span, w(self.submitted_at), w(first_token_at or now))
        if first_token_at is not None:
            t.child("frontend.stream", span, w(first_token_at), w(last_token_at or now))
        if self._detokenize is not None:
            t.child("frontend.detokenize", span, *(w(x) for x in self._detokenize))
        span.end(end_time=w(now))


def request_trace(
    tracing: Optional[Tracing], parent: Optional[str], received_at: float, client_id: str
) -> Optional[RequestTrace]:
    """A request's trace, or None when tracing is off."""
    return None if tracing is None else RequestTrace(tracing, parent, received_at, client_id)
