"""The FastAPI app: OpenAI routes, /metrics; one engine client for the whole process.

/health and the refusals of clients at their cap are answered in front of it (front_door.py).

Each HTTP request becomes one streaming engine request per choice (fanout.py). Non-streaming
requests collect the streams; streaming ones forward them as server-sent events. Either way, a
client that disconnects gets its engine requests aborted: streaming through Starlette's
disconnect listener (which cancels the response), non-streaming through `_until_disconnect`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Optional, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from services.gateway.admission import Admission, Slot, client_key
from services.gateway.api_keys import ApiKey, ApiKeys
from services.gateway.auth import KEY_STATE, ApiKeyMiddleware
from services.gateway.body_limit import BodyLimitMiddleware
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import (
    EmbeddingRequest,
    embeddings_body,
    plan_embeddings,
    run_embeddings,
)
from services.gateway.errors import ApiError, from_validation_errors
from services.gateway.events import ChoiceEnd
from services.gateway.fanout import ChoiceRuns
from services.gateway.front_door import FrontDoor
from services.gateway.health import HealthWatch
from services.gateway.metrics import GatewayMetrics, StatsPoller
from services.gateway.openai_schema import (
    ChatRequest,
    CompletionRequest,
    EngineCallPlan,
    GatewayLimits,
    plan_chat,
    plan_completion,
)
from services.gateway.responses import ChoiceState, Kind, ResponseMeta, full_body, usage
from services.gateway.streaming import ClosingStreamingResponse, sse_body
from shared.client import AsyncClient
from shared.protocol.errors import ErrorCode
from shared.tracing import Tracing, open_span

T = TypeVar("T")
STATS_TIMEOUT_S = 5.0  # the frontend itself waits up to 2 s for the scheduler's part
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads it, logs do
STOP_ROUND_S = 0.5  # shutdown: how long a cancelled poll gets before it is cancelled again
STOP_ROUNDS = 10


class Gateway:
    """Route handlers and the live objects they share (engine client, metrics)."""

    def __init__(self, config: GatewayConfig, log: Any, tracing: Optional[Tracing] = None) -> None:
        self.config = config
        self.log = log
        self.tracing = tracing  # a span per request (shared/tracing.py); None: off
        self.client = AsyncClient(
            [config.engine_addr, *config.more_frontend_addrs],  # a lost one: the next resumes
            timeout=config.engine_timeout_s,
            max_frame_bytes=config.max_frame_bytes,
            routing_id=f"gateway-{uuid.uuid4().hex}".encode(),  # exempt from the frontend's cap
            server_key=config.server_key,
            client_key=config.client_key,
            resume_timeout=config.frontend_resume_timeout_s,
        )
        self.keys = ApiKeys.load(config.api_key, config.api_key_file)  # None: no authentication
        self.admission = Admission(config.max_requests_per_client)
        self.health = HealthWatch(self.client)
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.poller = StatsPoller(
            self.client, self.metrics.engine, config.stats_interval_s, STATS_TIMEOUT_S
        )
        self.limits = GatewayLimits(
            config.served_model_name, config.max_choices, config.default_max_tokens
        )
        self.started_at = int(time.time())

    # ---- routes ------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve("completion", plan_completion(body, self.limits), request)

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        return await self._serve("chat", plan_chat(body, self.limits), request)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        plan = plan_embeddings(body, self.limits)
        if isinstance(plan, ApiError):
            return error_response(plan)
        rid = f"embd-{uuid.uuid4().hex}"
        self.log.info("request", rid=rid, kind="embeddings", num_inputs=len(plan))
        span = open_span(self.tracing, "gateway.embeddings", request, rid)
        try:
            tp = self.tracing.traceparent(span) if self.tracing and span else None
            results = await run_embeddings(self.client, plan, rid, tp)
        finally:
            if span is not None:
                span.end()
        if isinstance(results, ApiError):
            return error_response(results)
        model = self.config.served_model_name
        return _json(embeddings_body(results, body.encoding_format, model))

    async def models(self) -> Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.started_at,
            "owned_by": "conveyor",
            "root": name,
            "parent": None,
        }
        return _json({"object": "list", "data": [card]})

    async def metrics_text(self) -> Response:
        await self.poller.refresh()  # fresh engine gauges; on failure the last values stay
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- one OpenAI request ------------------------------------------------------------------

    async def _serve(
        self, kind: Kind, plan: EngineCallPlan | ApiError, request: Request
    ) -> Response:
        if isinstance(plan, ApiError):
            return error_response(plan)
        key = client_key(request.scope)
        slot = self.admission.take(key, len(plan.calls))
        if slot is None:
            return error_response(self.admission.refusal(key))
        try:
            return await self._serve_counted(kind, plan, request, slot)
        except BaseException:
            slot.release()
            raise

    async def _serve_counted(
        self, kind: Kind, plan: EngineCallPlan, request: Request, slot: Slot
    ) -> Response:
        """The request, counted against its client until its engine requests are closed."""

        async def close_and_release() -> None:
            await runs.aclose()
            slot.release()
            if span is not None:
                span.end()

        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        meta = ResponseMeta(
            kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name
        )
        span = open_span(self.tracing, f"gateway.{kind}", request, meta.id)
        trace = {"traceparent": self.tracing.traceparent(span)} if self.tracing and span else {}
        key: Optional[ApiKey] = request.scope.get("state", {}).get(KEY_STATE)  # auth.py's match
        key_class = key.slo_class if key is not None else None
        default = {"slo_class": key_class} if key_class is not None else {}  # the body's wins
        calls = [
            replace(
                c, kwargs={**default, **c.kwargs, "request_id": f"{meta.id}-{c.index}", **trace}
            )
            for c in plan.calls
        ]
        plan = replace(plan, calls=calls)
        self.log.info("request", rid=meta.id, kind=kind, num_choices=len(calls), stream=plan.stream)
        runs = ChoiceRuns(
            self.client, calls, self.metrics.observe_end, self.metrics.observe_aborted, self.log
        )
        runs.start()
        if plan.stream:  # the response closes runs
            return await self._stream(request, meta, plan, runs, close_and_release)
        try:
            return await self._whole(request, meta, plan, runs)
        finally:
            await close_and_release()

    async def _stream(
        self,
        request: Request,
        meta: ResponseMeta,
        plan: EngineCallPlan,
        runs: ChoiceRuns,
        close: Callable[[], Awaitable[None]],
    ) -> Response:
        """Wait for every choice's first event so that a refusal is a real HTTP error."""
        handed_over = False  # once the response owns `runs`, it closes them
        try:
            gone, failed = await _until_disconnect(request, runs.first_error())
            if gone:
                return Response(status_code=CLIENT_GONE_STATUS)
            if failed is not None:
                return self._failure(meta, failed)
            body = sse_body(meta, plan, runs, self.metrics.observe_error, self.log)
            handed_over = True
            return ClosingStreamingResponse(body, on_close=close)
        finally:
            if not handed_over:
                await close()

    async def _whole(
        self, request: Request, meta: ResponseMeta, plan: EngineCallPlan, runs: ChoiceRuns
    ) -> Response:
        states = [ChoiceState() for _ in plan.calls]
        gone, failed = await _until_disconnect(request, _collect(runs, states))
        if gone:
            self.log.info("client_gone", rid=meta.id)
            return Response(status_code=CLIENT_GONE_STATUS)
        if failed is not None:
            return self._failure(meta, failed)
        body = full_body(
            meta, states, plan.calls, plan.num_logprobs is not None, plan.tool_mode is not None
        )
        self.log.info(
            "request_done",
            rid=meta.id,
            usage=usage(plan.calls, [s.end for s in states if s.end is not None]),
        )
        return _json(body)

    def _failure(self, meta: ResponseMeta, failed: ChoiceEnd) -> Response:
        err = failed.error or ApiError(500, "request failed", "server_error")
        self.metrics.observe_error(err.code)
        self.log.info(
            "request_failed", rid=meta.id, status=err.status, code=err.code, message=err.message
        )
        return error_response(err)


async def _collect(runs: ChoiceRuns, states: list[ChoiceState]) -> Optional[ChoiceEnd]:
    """Every choice's text and logprobs into `states`; the failed choice's end, if one failed."""
    async for event in runs.events():
        st = states[event.index]
        if isinstance(event, ChoiceEnd):
            if event.error is not None:
                return event
            st.end = event
        else:
            st.add(event)
    return None


async def _until_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, Optional[T]]:
    """Run `work` unless the HTTP client disconnects first: (gone, result)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, gone_task):
            task.cancel()
        await asyncio.gather(work_task, gone_task, return_exceptions=True)
    if work_task.cancelled():
        return True, None
    return False, work_task.result()


async def _wait_disconnect(request: Request) -> None:
    """The body was read already, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(err: ApiError) -> Response:
    headers = None if err.retry_after_s is None else {"Retry-After": str(err.retry_after_s)}
    return Response(orjson.dumps(err.body()), status_code=err.status, headers=headers,
                    media_type="application/json")  # fmt: skip


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def stop_tasks(tasks: list[asyncio.Task[None]], max_rounds: int = STOP_ROUNDS) -> None:
    """Called at shutdown: cancel the background polls and wait for them, sending the cancel
    again while one still runs (at most `max_rounds` rounds of STOP_ROUND_S). On Python <= 3.11
    `asyncio.wait_for` returns the inner call's result and drops a cancel that arrives as that
    call finishes; the poll then loops on, and a plain gather left the gateway running after
    SIGTERM until it was killed."""
    pending = set(tasks)
    for _ in range(max_rounds):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=STOP_ROUND_S)


def create_app(config: GatewayConfig, log: Any, tracing: Optional[Tracing] = None) -> FastAPI:
    """The ASGI app; the engine client connects lazily, the stats poller runs while it serves.
    `tracing`: a span per request (None: tracing off)."""
    gw = Gateway(config, log, tracing)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        polls = [asyncio.create_task(gw.poller.run()), asyncio.create_task(gw.health.run())]
        try:
            yield
        finally:
            await stop_tasks(polls)
            await gw.client.close()
            if tracing is not None:
                tracing.shutdown()

    app = FastAPI(title="Conveyor OpenAI-compatible gateway", lifespan=lifespan)
    app.state.gateway = gw
    if gw.keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=gw.keys)
    # added last, so it runs first: a huge body is refused before anything reads it
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    # outermost: /health and the refusals of clients at their cap, before any of the above (an
    # unauthenticated request is never at a cap: only admitted requests count)
    app.add_middleware(FrontDoor, health=gw.health, admission=gw.admission)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_bug)
    routes: list[tuple[str, Callable[..., Awaitable[Response]], str]] = [
        ("/v1/completions", gw.completions, "POST"),
        ("/v1/chat/completions", gw.chat_completions, "POST"),
        ("/v1/embeddings", gw.embeddings, "POST"),
        ("/v1/models", gw.models, "GET"),
        ("/metrics", gw.metrics_text, "GET"),
    ]
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method], response_class=Response)
    return app


async def _on_validation_error(_: Request, exc: RequestValidationError) -> Response:
    return error_response(from_validation_errors(exc.errors()))


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(ApiError(exc.status_code, str(exc.detail), kind))


async def _on_bug(_: Request, exc: Exception) -> Response:
    """Anything unexpected: still an OpenAI-shaped 500 (the server logs the traceback)."""
    message = f"internal error: {type(exc).__name__} (logged)"
    return error_response(ApiError(500, message, "server_error", None, ErrorCode.INTERNAL))
