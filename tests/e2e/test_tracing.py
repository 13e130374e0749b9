"""OpenTelemetry traces end to end (shared/tracing.py, README "Tracing").

A real stack (real model) exports to an OTLP/HTTP receiver the test starts, which decodes every
payload with opentelemetry-proto. One chat completion through the gateway, sent with a W3C
`traceparent` header, must leave one trace under the client's span: the gateway's span, the
frontend's request span and its tokenize / queue / stream / detokenize children, the
scheduler's request span with waiting and running, and at least one worker step span (a trace
of its own) linking the frontend's request span; the frontend's and the scheduler's spans carry
the same request id. An `embed` over the ZeroMQ protocol with its own traceparent is traced too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conveyor.launcher import LocalStack
from shared.client import Client
from shared.env import LogConfig
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import engine_settings, free_port, running_stack

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
EMBED_TRACE = "0af7651916cd43dd8448eb211c80319c"
EXPORT_DELAY_S = 0.5  # the batch processor's schedule delay (shared/tracing.py)


class Receiver:
    """Every span the services export, decoded: a dict per span with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces", self.path
                assert self.headers["Content-Type"] == "application/x-protobuf"
                receiver.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for rs in request.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    span = {"service": service.get("service.name"), "name": s.name,
                            "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "attrs": attrs,
                            "links": [(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            "events": [e.name for e in s.events]}  # fmt: skip
                    with self.lock:
                        self.spans.append(span)

    def wait_for(self, names: set[str], trace: str, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                mine = [s for s in self.spans if s["trace"] == trace]
            if names <= {s["name"] for s in mine} or time.monotonic() > deadline:
                return mine
            time.sleep(0.1)


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Receiver]]:
    receiver = Receiver()
    logs = LogConfig(otlp_endpoint=f"127.0.0.1:{receiver.port}")
    settings = engine_settings(Path(tmp_path_factory.mktemp("traced-logs")), logs=logs)
    try:
        for stack in running_stack(settings):
            yield stack, receiver
    finally:
        receiver.server.shutdown()


def test_one_trace_per_request(traced: tuple[LocalStack, Receiver]) -> None:
    stack, receiver = traced
    assert stack.http_url is not None
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    reply = httpx.post(stack.http_url + "/v1/chat/completions", json=body, headers=headers,
                       timeout=120)  # fmt: skip
    assert reply.status_code == 200, reply.text
    expected = {"gateway.chat", "frontend.request", "frontend.tokenize", "frontend.queue",
                "frontend.stream", "frontend.detokenize", "scheduler.request",
                "scheduler.waiting", "scheduler.running"}  # fmt: skip
    spans = receiver.wait_for(expected, CLIENT_TRACE, 5 * EXPORT_DELAY_S + SLOW_HOST_MARGIN_S)
    by_name = {s["name"]: s for s in spans}
    assert expected <= set(by_name), sorted(by_name)
    assert len([s for s in spans if s["name"] == "frontend.request"]) == 1
    gateway, request = by_name["gateway.chat"], by_name["frontend.request"]
    assert gateway["parent"] == CLIENT_SPAN and gateway["service"] == "conveyor-gateway"
    assert request["parent"] == gateway["id"] and request["service"] == "conveyor-tokenizer"
    for name in ("frontend.tokenize", "frontend.queue", "frontend.stream", "frontend.detokenize"):
        assert by_name[name]["parent"] == request["id"], name
    sched = by_name["scheduler.request"]
    assert sched["parent"] == request["id"] and sched["service"] == "conveyor-scheduler"
    assert sched["attrs"]["conveyor.rid"] == request["attrs"]["conveyor.rid"]
    assert sched["attrs"]["conveyor.finish_reason"] in ("length", "stop")
    assert {"admitted", "finished"} <= set(sched["events"])
    for name in ("scheduler.waiting", "scheduler.running"):
        assert by_name[name]["parent"] == sched["id"], name
    deadline = time.monotonic() + 5 * EXPORT_DELAY_S + SLOW_HOST_MARGIN_S
    while True:
        with receiver.lock:
            steps = [s for s in receiver.spans if s["name"] == "worker.step"
                     and (CLIENT_TRACE, request["id"]) in s["links"]]  # fmt: skip
        if len(steps) >= 2 or time.monotonic() > deadline:  # spans come in batches
            break
        time.sleep(0.1)
    assert steps, "no worker step linked the request"
    assert all(s["service"] == "conveyor-worker" and s["trace"] != CLIENT_TRACE for s in steps)
    # a prefill, then decodes: 4 tokens were sampled over at least 2 steps
    assert len(steps) >= 2


def test_embed_traced_over_zeromq(traced: tuple[LocalStack, Receiver]) -> None:
    stack, receiver = traced
    parent = f"00-{EMBED_TRACE}-{CLIENT_SPAN}-01"
    with Client(stack.frontend_address, timeout=120) as client:
        client.embed("Another text", pooling="mean", request_id="e2", traceparent=parent)
    spans = receiver.wait_for({"frontend.request", "scheduler.request"}, EMBED_TRACE,
                              5 * EXPORT_DELAY_S + SLOW_HOST_MARGIN_S)  # fmt: skip
    request = next(s for s in spans if s["name"] == "frontend.request")
    assert request["parent"] == CLIENT_SPAN
    assert request["attrs"]["conveyor.client_id"] == "e2"
    sched = next(s for s in spans if s["name"] == "scheduler.request")
    assert sched["parent"] == request["id"]
