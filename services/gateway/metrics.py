"""Prometheus metrics in vLLM's naming style (`conveyor:...`), in one registry per gateway.

Two sources feed them:
* every finished choice's `done` (engine timings and token counts) -> histograms and counters;
* the engine's `stats` reply, polled every few seconds by `StatsPoller` -> gauges and the
  preemption counter, rendered at scrape time by `EngineStatsCollector`.
The registry is owned by the app (no process-global registry), so tests can build several.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.events import ChoiceEnd
from shared.client.types import EngineError

PREFIX = "conveyor:"

# vLLM's buckets for request latencies (seconds), trimmed to what a small engine sees.
_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
_TOKEN_GAP_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

# Our gauge -> the scheduler stats keys that may hold it, first present wins (the names of
# services/scheduler/scheduler.py `stats()`).
_ENGINE_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "num_requests_running": ("Requests in the running batch.", ("num_running",)),
    "num_requests_waiting": ("Requests in the waiting queue.", ("num_waiting",)),
    "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (1 = full).", ("kv_usage",)),
    "kv_cache_blocks_used": ("KV cache blocks in use.", ("kv_blocks_used",)),
    "kv_cache_blocks_total": ("KV cache blocks in the pool.", ("kv_blocks_total",)),
    "batch_utilization": ("Running requests / max_num_seqs.", ("batch_utilization",)),
    "prefix_cache_hit_rate": (
        "Prompt tokens found cached / looked up, since start.",
        ("prefix_cache_hit_rate",),
    ),
    "prefix_cache_blocks": ("KV blocks findable in the prefix cache.", ("prefix_cache_blocks",)),
}
_ENGINE_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "num_preemptions": ("Preemptions since the engine started.", ("num_preemptions",)),
    "prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache.",
        ("prefix_cache_queries",),
    ),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", ("prefix_cache_hits",)),
    # speculative decoding, in vLLM's names (docs/design/speculation.md)
    "spec_decode_num_drafts": (
        "Drafts verified (rows that proposed).",
        ("spec_decode_num_drafts",),
    ),
    "spec_decode_num_draft_tokens": (
        "Draft tokens verified.",
        ("spec_decode_num_draft_tokens",),
    ),
    "spec_decode_num_accepted_tokens": (
        "Draft tokens accepted.",
        ("spec_decode_num_accepted_tokens",),
    ),
}
# spec_decode_num_accepted_tokens_pos_<j> -> one counter labelled by draft position, as vLLM's
_PER_POSITION = "spec_decode_num_accepted_tokens_pos_"
# Any other scheduler stat: `num_*` are counters since start (the scheduler's convention: its
# only `num_*` gauges are mapped above), anything else a gauge; named conveyor:engine_<key>.
_COUNTER_PREFIX = "num_"


class GatewayMetrics:
    """Per-request metrics. `observe_end` is called once per finished choice."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttft = _histogram(
            registry,
            "time_to_first_token_seconds",
            "Time to first token (engine receipt -> first token).",
            _LATENCY_BUCKETS,
        )
        self.inter_token = _histogram(
            registry,
            "inter_token_latency_seconds",
            "Mean time per output token after the first, per request.",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e = _histogram(
            registry,
            "e2e_request_latency_seconds",
            "End-to-end request latency in the engine.",
            _LATENCY_BUCKETS,
        )
        self.queue = _histogram(
            registry,
            "request_queue_time_seconds",
            "Time spent waiting before first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.prompt_len = _histogram(
            registry, "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_COUNT_BUCKETS
        )
        self.output_len = _histogram(
            registry,
            "request_generation_tokens",
            "Generated tokens per request.",
            _TOKEN_COUNT_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", registry=registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=registry
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Requests finished, by reason.",
            ["finished_reason"],
            registry=registry,
        )
        self.errors = Counter(
            PREFIX + "request_errors",
            "Requests failed, by error code.",
            ["code"],
            registry=registry,
        )
        self.engine = EngineStatsCollector()
        registry.register(self.engine)

    def observe_end(self, end: ChoiceEnd) -> None:
        """A choice finished normally: its timings and token counts."""
        self.finished.labels(end.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(end.num_prompt_tokens)
        self.generation_tokens.inc(end.num_output_tokens)
        self.prompt_len.observe(end.num_prompt_tokens)
        self.output_len.observe(end.num_output_tokens)
        pairs = (
            (self.ttft, end.times.ttft_s),
            (self.inter_token, end.times.tpot_s),
            (self.e2e, end.times.e2e_s),
            (self.queue, end.times.queue_s),
        )
        for hist, value in pairs:
            if value is not None:
                hist.observe(value)

    def observe_aborted(self, num_choices: int) -> None:
        """Choices cut short by the gateway (client left, or a sibling choice failed)."""
        self.finished.labels("abort").inc(num_choices)

    def observe_error(self, code: Optional[str]) -> None:
        self.errors.labels(code or "unknown").inc()


class EngineStatsCollector:
    """Renders the latest engine stats at scrape time. `update` is called by `StatsPoller`.

    Engine figures carry an `engine` label: one series per engine behind the frontend (its
    name, "0", "1", ...; data parallelism), from the reply's `engines` map (a frontend that
    sends none has one engine, "0")."""

    def __init__(self) -> None:
        self._engines: dict[str, Mapping[str, float]] = {}
        self._frontend: Mapping[str, float] = {}
        self._ready: Optional[bool] = None

    def update(self, reply: Mapping[str, Any]) -> None:
        """`reply` is the protocol's stats reply: {ready, frontend: {...}, engine: {...}|nil,
        engines: {name: {...}|nil}}."""
        self._ready = bool(reply.get("ready"))
        engines = reply.get("engines")
        if isinstance(engines, Mapping):
            self._engines = {str(k): _numbers(v) for k, v in engines.items() if v}
        else:
            engine = _numbers(reply.get("engine"))
            self._engines = {"0": engine} if engine else {}
        self._frontend = _numbers(reply.get("frontend"))

    def collect(self) -> Iterator[Metric]:
        if self._ready is not None:
            yield GaugeMetricFamily(
                PREFIX + "engine_ready",
                "1 when the engine accepts requests.",
                value=1.0 if self._ready else 0.0,
            )
        yield from self._engine_families()
        for key, value in sorted(self._frontend.items()):
            name, doc = PREFIX + "frontend_" + _clean(key), f"Frontend stat '{key}'."
            if key.endswith("_total"):
                yield CounterMetricFamily(name, doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)

    def _engine_families(self) -> Iterator[Metric]:
        """One family per figure, one sample per engine (label `engine`)."""
        families: dict[str, Metric] = {}

        def add(kind: type, name: str, doc: str, engine: str, value: float) -> None:
            if name not in families:
                families[name] = kind(name, doc, labels=["engine"])
            families[name].add_metric([engine], value)

        # Everything else the scheduler reports too, so new stats show up without a release.
        known = {k for _, keys in (*_ENGINE_GAUGES.values(), *_ENGINE_COUNTERS.values())
                 for k in keys}  # fmt: skip
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=["engine", "position"])  # fmt: skip
        for engine, stats in sorted(self._engines.items()):
            for name, (doc, keys) in _ENGINE_GAUGES.items():
                if (value := _first(stats, keys)) is not None:
                    add(GaugeMetricFamily, PREFIX + name, doc, engine, value)
            for name, (doc, keys) in _ENGINE_COUNTERS.items():
                if (value := _first(stats, keys)) is not None:
                    add(CounterMetricFamily, PREFIX + name, doc, engine, value)
            for key, value in sorted(stats.items()):
                if key in known:
                    continue
                if key.startswith(_PER_POSITION):
                    per_pos.add_metric([engine, key[len(_PER_POSITION) :]], value)
                    continue
                name, doc = PREFIX + "engine_" + _clean(key), f"Scheduler stat '{key}'."
                kind = CounterMetricFamily if key.startswith(_COUNTER_PREFIX) else GaugeMetricFamily
                add(kind, name, doc, engine, value)
        yield from families.values()
        if per_pos.samples:
            yield per_pos


class StatsPoller:
    """Asks the engine for `stats` every `interval` seconds and feeds the collector.

    Runs as one background task for the app's lifetime; a failed or slow reply only leaves the
    previous values in place (the scrape must not fail because the engine is busy).
    """

    def __init__(
        self, client: Any, collector: EngineStatsCollector, interval: float, timeout: float
    ) -> None:
        self._client = client
        self._collector = collector
        self._interval = interval
        self._timeout = timeout

    async def refresh(self) -> bool:
        """One stats round trip; True when fresh values arrived."""
        try:
            reply = await asyncio.wait_for(self._client.stats(), self._timeout)
        except (asyncio.TimeoutError, EngineError):
            return False  # the previous values stay; the next round tries again
        self._collector.update(reply)
        return True

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)


def _histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...]
) -> Histogram:
    return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in value.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _first(stats: Mapping[str, float], keys: tuple[str, ...]) -> Optional[float]:
    for key in keys:
        if key in stats:
            return stats[key]
    return None


def _clean(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)
