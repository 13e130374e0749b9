"""Where requests go: Conveyor's ZeroMQ client, or any OpenAI-compatible HTTP server.

A backend sends one request, streams its output and returns what the client saw as a
`RequestTrace`. Times are taken here, on the benchmark's side, when each chunk is handed to us:
that is the latency a user of the server would see.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import httpx
import orjson

from conveyor.bench.metrics import RequestTrace
from conveyor.bench.workloads import BenchRequest
from shared.client import AsyncClient, EngineError

BACKENDS = ("conveyor", "openai")


@dataclass(frozen=True, slots=True)
class SamplingChoice:
    """Per-run sampling settings shared by every request (greedy by default: reproducible)."""

    temperature: float = 0.0
    ignore_eos: bool = False
    seed: Optional[int] = None


class Backend(Protocol):
    name: str

    async def send(self, req: BenchRequest, sampling: SamplingChoice) -> RequestTrace:
        """Called once per request, concurrently; never raises for a failed request (the trace
        says success=False and why)."""
        ...

    async def aclose(self) -> None:
        """Called once at the end of the run."""
        ...


class _Clock:
    """Collects one request's chunk arrival times (perf_counter) into a RequestTrace."""

    def __init__(self, req: BenchRequest) -> None:
        self.req = req
        self.start_wall = time.time()
        self.start = time.perf_counter()
        self.chunk_times: list[float] = []
        self.num_tokens = 0

    def chunk(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(time.perf_counter())
            self.num_tokens += num_tokens

    def finish(self, output_len: Optional[int] = None, rid: Optional[str] = None) -> RequestTrace:
        times = self.chunk_times
        if not times:
            return self.fail("no output tokens", rid)
        return RequestTrace(
            index=self.req.index,
            prompt_len=self.req.prompt_len,
            success=True,
            slo_class=self.req.slo_class,
            output_len=output_len if output_len is not None else self.num_tokens,
            start_wall=self.start_wall,
            ttft=times[0] - self.start,
            latency=times[-1] - self.start,
            itls=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
            rid=rid,
        )

    def fail(self, error: str, rid: Optional[str] = None) -> RequestTrace:
        return RequestTrace(
            index=self.req.index,
            prompt_len=self.req.prompt_len,
            success=False,
            slo_class=self.req.slo_class,
            start_wall=self.start_wall,
            latency=time.perf_counter() - self.start,  # a refusal's: how soon it came
            error=error,
            rid=rid,
        )


class ConveyorBackend:
    """Conveyor's own protocol through `shared.client.AsyncClient` (one client, many streams)."""

    name = "conveyor"

    def __init__(
        self,
        address: str,
        timeout: float = 600.0,
        id_prefix: str = "bench",
        targets: Optional[dict[str, dict[str, Any]]] = None,
    ) -> None:
        """`targets`: per goodput class, the fields sent with each of its requests (ttft_ms,
        tpot_ms, on_slo_miss)."""
        # `timeout` bounds the wait for each reply; a request queued behind a long static batch
        # can legitimately wait minutes for its first token.
        self._client = AsyncClient(address=address, timeout=timeout)
        self._id_prefix = id_prefix
        self._targets = targets or {}

    def request_id(self, req: BenchRequest) -> str:
        """The client id of a workload request (the step log's rids embed it)."""
        return f"{self._id_prefix}-{req.index}"

    async def send(self, req: BenchRequest, sampling: SamplingChoice) -> RequestTrace:
        clock = _Clock(req)
        rid = self.request_id(req)
        stream = self._client.stream(
            prompt_token_ids=req.prompt_token_ids,
            request_id=rid,
            max_tokens=req.max_tokens,
            temperature=sampling.temperature,
            ignore_eos=sampling.ignore_eos,
            seed=sampling.seed,
            **self._targets.get(req.slo_class or "", {}),
        )
        try:
            async for chunk in stream:
                clock.chunk(len(chunk.token_ids))
        except EngineError as exc:
            return clock.fail(f"{exc.code}: {exc.message}", rid)
        usage = stream.done.usage if stream.done is not None else {}
        return clock.finish(output_len=usage.get("completion_tokens"), rid=rid)

    async def aclose(self) -> None:
        await self._client.close()


class OpenAIBackend:
    """Any server with a streaming OpenAI `/v1/completions` endpoint (prompt as token ids)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, timeout: float = 600.0) -> None:
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False)

    async def send(self, req: BenchRequest, sampling: SamplingChoice) -> RequestTrace:
        payload: dict = {
            "model": self._model,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.max_tokens,
            "temperature": sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        clock = _Clock(req)
        try:
            async with self._http.stream("POST", self._url, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    return clock.fail(f"HTTP {resp.status_code}: {body[:300]}")
                rid, usage_tokens = await _read_sse(resp, clock)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            return clock.fail(f"{type(exc).__name__}: {exc}")
        return clock.finish(output_len=usage_tokens, rid=rid)

    async def aclose(self) -> None:
        await self._http.aclose()


async def _read_sse(resp: httpx.Response, clock: _Clock) -> tuple[Optional[str], Optional[int]]:
    """Feed each server-sent event's text chunk to the clock; returns (id, usage tokens)."""
    rid: Optional[str] = None
    usage_tokens: Optional[int] = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = orjson.loads(data)
        rid = event.get("id", rid)
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            # One SSE chunk is counted as one token until usage gives the exact count.
            clock.chunk(1)
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
    return rid, usage_tokens


def make_backend(
    name: str,
    *,
    address: str,
    base_url: str,
    model: str,
    id_prefix: str = "bench",
    targets: Optional[dict[str, dict[str, Any]]] = None,
) -> Backend:
    """`targets`: per goodput class, the latency-target fields its requests carry (conveyor
    backend only)."""
    if name == "conveyor":
        return ConveyorBackend(address, id_prefix=id_prefix, targets=targets)
    if name == "openai":
        return OpenAIBackend(base_url, model)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
