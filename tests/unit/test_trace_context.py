"""shared/tracing.py without a stack: the OTLP URL an endpoint means, which traceparents are
accepted (W3C: an invalid one is ignored), and that a span made under a traceparent carries
its trace and names its parent, as the next service reads it back."""

from __future__ import annotations

import pytest

from shared.tracing import Tracing, traces_url, valid_traceparent

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("collector", "http://collector:4318/v1/traces"),
        ("127.0.0.1:4319", "http://127.0.0.1:4319/v1/traces"),
        ("https://otel.example:443", "https://otel.example:443/v1/traces"),
        ("http://otel:4318/custom/path", "http://otel:4318/custom/path"),
    ],
)
def test_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


def test_traces_url_needs_a_host() -> None:
    with pytest.raises(ValueError):
        traces_url("http://:4318")


@pytest.mark.parametrize(
    "value",
    [
        None,
        17,
        "",
        GOOD.upper(),
        GOOD.replace("00-", "01-", 1),
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        GOOD[:-1] + "g",
        GOOD + "-",
    ],
)
def test_invalid_traceparents_are_ignored(value: object) -> None:
    assert valid_traceparent(value) is None


def test_a_span_carries_its_parents_trace() -> None:
    tracing = Tracing("test", "127.0.0.1:9")  # nothing listens: nothing is sent in this test
    span = tracing.start("child", GOOD)
    context = span.get_span_context()
    assert f"{context.trace_id:032x}" == GOOD.split("-")[1]
    assert f"{span.parent.span_id:016x}" == GOOD.split("-")[2]
    passed_on = tracing.traceparent(span)
    assert valid_traceparent(passed_on) == passed_on
    assert passed_on.split("-")[2] == f"{context.span_id:016x}"
    link = tracing.start("step", None, links=[passed_on])
    assert [ln.context.span_id for ln in link.links] == [context.span_id]
    assert link.get_span_context().trace_id != context.trace_id  # a trace of its own
    # not ended: nothing is exported to the address no one listens on
