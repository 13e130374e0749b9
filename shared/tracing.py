"""OpenTelemetry traces across the services (README "Tracing"): off unless an OTLP endpoint is
set (`--otlp-endpoint`, CONVEYOR_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT).

One trace per request: the gateway's span (a child of the HTTP client's W3C `traceparent`
when it sent one), the frontend's request span and its tokenize / queue / stream / detokenize
children, the scheduler's request span with its waiting and running spans (a preemption ends a
running span and starts a waiting one), and the worker's step spans, one trace of their own
per step, linking every request they computed. The context crosses the ZeroMQ messages as a
`traceparent` string field (client `generate`, SubmitRequest, NewSequence).

Every service holds an `Optional[Tracing]`: None when tracing is off, so the cost then is one
`is None` test where a request opens or ends (never per token or per step). Spans whose times
are known only afterwards (the scheduler's, the frontend's children) are built when the request
ends, from the timestamps the services keep anyway. Spans go out in batches from a background
thread over OTLP/HTTP protobuf (`<endpoint>/v1/traces`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional
from urllib.parse import urlsplit

TRACEPARENT = "traceparent"
DEFAULT_OTLP_PORT = 4318  # OTLP over HTTP


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint given as `host[:port]` or a URL: a URL with a
    path is used as it is; otherwise `/v1/traces` is added (as OTEL_EXPORTER_OTLP_ENDPOINT
    means), and port 4318 when none is given."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"the OTLP endpoint {endpoint!r} names no host")
    if parts.path not in ("", "/"):
        return url
    netloc = parts.netloc if parts.port else f"{parts.netloc}:{DEFAULT_OTLP_PORT}"
    return f"{parts.scheme}://{netloc}/v1/traces"


def valid_traceparent(value: Any) -> Optional[str]:
    """`value` when it is a W3C traceparent (version 00: 55 characters, lowercase hex, ids not
    all zeros), else None: an invalid one is ignored, as W3C Trace Context asks."""
    if not isinstance(value, str) or len(value) != 55:
        return None
    version, trace_id, span_id, flags = (value.split("-") + ["", "", "", ""])[:4]
    fields_ok = (version == "00", len(trace_id) == 32, len(span_id) == 16, len(flags) == 2)
    if not all(fields_ok) or not all(_hex(x) for x in (trace_id, span_id, flags)):
        return None
    if set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return value


def _hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


class Tracing:
    """One service's tracer provider and OTLP/HTTP exporter (one per process, made at start
    when an endpoint is set; `shutdown` at exit sends what is left)."""

    def __init__(self, service: str, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({"service.name": f"conveyor-{service}"})
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=5)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self._provider.get_tracer("conveyor")
        self._propagator = TraceContextTextMapPropagator()
        # monotonic seconds -> epoch ns (the services time requests with time.monotonic())
        self._offset_s = time.time() - time.monotonic()

    def wall_ns(self, monotonic_s: float) -> int:
        return int((monotonic_s + self._offset_s) * 1e9)

    def context(self, traceparent: Optional[str]) -> Any:
        """The OpenTelemetry context a span with this remote parent starts in (None: a root)."""
        if traceparent is None:
            return None
        return self._propagator.extract({TRACEPARENT: traceparent})

    def traceparent(self, span: Any) -> str:
        """The W3C traceparent that makes `span` the parent on the other side of a message."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier[TRACEPARENT]

    def start(
        self,
        name: str,
        parent: Optional[str],
        start_ns: Optional[int] = None,
        attributes: Optional[Mapping[str, Any]] = None,
        links: Sequence[str] = (),
        kind: Any = None,
    ) -> Any:
        """Start a span under the remote `parent` (a traceparent; None: a new trace), linking
        the spans named by `links` (traceparents); the caller ends it (`span.end(end_time)`)."""
        from opentelemetry import trace

        link_objs = [trace.Link(ctx) for ctx in (self.span_context(tp) for tp in links) if ctx]
        return self.tracer.start_span(
            name,
            context=self.context(parent),
            kind=kind if kind is not None else trace.SpanKind.INTERNAL,
            attributes=dict(attributes or {}),
            links=link_objs,
            start_time=start_ns,
        )

    def child(self, name: str, parent: Any, start_ns: int, end_ns: int, **attributes: Any) -> Any:
        """A finished span under the local span `parent`, from start_ns to end_ns."""
        from opentelemetry import trace

        ctx = trace.set_span_in_context(parent)
        span = self.tracer.start_span(name, context=ctx, attributes=attributes, start_time=start_ns)
        span.end(end_time=max(start_ns, end_ns))
        return span

    def span_context(self, traceparent: str) -> Any:
        """The remote SpanContext a traceparent names (None when invalid), for links."""
        from opentelemetry import trace

        ctx = trace.get_current_span(self.context(traceparent)).get_span_context()
        return ctx if ctx.is_valid else None

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (called once at process exit)."""
        self._provider.shutdown()


def open_span(tracing: Optional[Tracing], name: str, request: Any, rid: str) -> Any:
    """An HTTP request's server span under the `traceparent` header it carried (a valid one;
    else a new trace), or None when tracing is off. `request`: a Starlette request."""
    if tracing is None:
        return None
    from opentelemetry.trace import SpanKind

    parent = valid_traceparent(request.headers.get(TRACEPARENT))
    attrs = {"conveyor.rid": rid, "http.route": request.url.path}
    return tracing.start(name, parent, attributes=attrs, kind=SpanKind.SERVER)


def start_tracing(service: str, endpoint: Optional[str], log: Any = None) -> Optional[Tracing]:
    """The service's tracing (`endpoint`, else OTEL_EXPORTER_OTLP_ENDPOINT), or None when
    neither is set: tracing off."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    tracing = Tracing(service, endpoint)
    if log is not None:
        log.info("tracing_on", otlp_endpoint=traces_url(endpoint))
    return tracing
