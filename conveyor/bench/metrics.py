"""Serving metrics from per-request traces, named as `vllm bench serve` names them.

Definitions (all latencies measured by the client, from the moment the request is sent):
* TTFT: time to the first chunk carrying output tokens.
* E2EL: time to the last chunk (the request's end-to-end latency).
* TPOT: per request, (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token.
* ITL: every gap between two successive chunks of a request, pooled over all requests.
* Throughputs: totals over completed requests divided by the run's duration (first send to last
  completion). Goodput: completed requests meeting every given SLO, per second (with classes:
  their own class's); a refused request never counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# errors that are an engine's refusal at admission (a failed trace's error starts with its code)
REFUSAL_CODES = ("slo_unattainable", "overloaded")

Number = Union[int, float, None]


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What the client saw of one request. Times in seconds; `start_wall` is time.time() at
    send (the scheduler logs the same clock, so the timeline can put both on one axis)."""

    index: int
    prompt_len: int
    success: bool
    output_len: int = 0
    start_wall: float = 0.0
    ttft: Optional[float] = None
    latency: Optional[float] = None
    itls: tuple[float, ...] = field(default_factory=tuple)
    error: str = ""
    rid: Optional[str] = None
    slo_class: Optional[str] = None  # its goodput class (`--goodput NAME=...`), if any

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_len < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True, slots=True)
class SLOs:
    """Service-level objectives for goodput, in milliseconds; None = not constrained."""

    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    e2el_ms: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {value}")

    def met_by(self, trace: RequestTrace) -> bool:
        if not trace.success:
            return False
        checks = (
            (self.ttft_ms, trace.ttft),
            (self.tpot_ms, trace.tpot or 0.0),
            (self.e2el_ms, trace.latency),
        )
        return all(slo is None or (v is not None and v * 1000.0 <= slo) for slo, v in checks)


@dataclass(frozen=True, slots=True)
class GoodputClass:
    """A class of requests with its own targets (`--goodput NAME=ttft:MS,tpot:MS,share:F`):
    `share` of the workload's requests belong to it, and its targets are sent with each."""

    name: str
    slos: SLOs
    share: float = 1.0


def parse_goodput(items: Sequence[str]) -> tuple[Optional[SLOs], list[GoodputClass]]:
    """`--goodput`: vLLM's `ttft:MS tpot:MS` (one set of SLOs for every request), or classes
    `NAME=ttft:MS,tpot:MS[,share:F]`, one item each (not both forms)."""
    classes = [i for i in items if "=" in i]
    if not classes:
        return parse_slos(items), []
    if len(classes) != len(items):
        raise ValueError("--goodput: give either ttft:MS tpot:MS or NAME=ttft:MS,... classes")
    out = []
    for item in classes:
        name, _, spec = item.partition("=")
        parts = [x for x in spec.split(",") if x]
        share = [float(x.partition(":")[2]) for x in parts if x.startswith("share:")]
        slos = parse_slos([x for x in parts if not x.startswith("share:")])
        if not name or slos is None or (share and not share[0] > 0):
            raise ValueError(f"--goodput {item!r}: use NAME=ttft:MS,tpot:MS[,share:F]")
        out.append(GoodputClass(name, slos, share[0] if share else 1.0))
    return None, out


def class_of(index: int, classes: Sequence[GoodputClass], seed: int = 0) -> Optional[str]:
    """The class of workload request `index`: drawn by share, the same for every run."""
    if not classes:
        return None
    total = sum(c.share for c in classes)
    u = ((index * 2654435761 + seed) % 2**32) / 2**32 * total  # a fixed, well-spread draw
    for c in classes:
        if u < c.share:
            return c.name
        u -= c.share
    return classes[-1].name


def parse_slos(items: Sequence[str]) -> Optional[SLOs]:
    """`["ttft:200", "tpot:50"]` (vLLM's --goodput syntax, milliseconds) -> SLOs."""
    if not items:
        return None
    values: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        try:
            values[f"{name}_ms"] = float(raw)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {raw!r} is not a number") from None
    return SLOs(**values)


def percentile_key(p: float) -> str:
    """99.0 -> 'p99', 99.9 -> 'p99.9' (vLLM's spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def compute_metrics(
    traces: Sequence[RequestTrace],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slos: Optional[SLOs] = None,
    classes: Sequence[GoodputClass] = (),
) -> dict[str, Number]:
    """The result fields of one run; `duration_s` from first send to last completion. With
    `classes`, each request is held to its own class's SLOs; a refused request (failed) is a
    miss either way."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    done = [t for t in traces if t.success]
    total_in = sum(t.prompt_len for t in done)
    total_out = sum(t.output_len for t in done)
    out: dict[str, Number] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(traces) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    if slos is not None:
        out["request_goodput"] = sum(1 for t in done if slos.met_by(t)) / duration_s
    if classes:
        by_name = {c.name: c.slos for c in classes}
        met = [t for t in done if t.slo_class in by_name and by_name[t.slo_class].met_by(t)]
        out["request_goodput"] = len(met) / duration_s
        refusals = [t for t in traces if t.error.startswith(REFUSAL_CODES)]
        out["num_refused"] = len(refusals)
        waits_ms = [1000.0 * t.latency for t in refusals if t.latency is not None]  # to refusal
        out["p99_refusal_ms"] = float(np.percentile(waits_ms, 99)) if waits_ms else None
        out["max_refusal_ms"] = max(waits_ms) if waits_ms else None
        out["met_share_of_admitted"] = len(met) / len(done) if done else None
    samples = {
        "ttft": [t.ttft for t in done if t.ttft is not None],
        "tpot": [v for v in (t.tpot for t in done) if v is not None],
        "itl": [gap for t in done for gap in t.itls],
        "e2el": [t.latency for t in done if t.latency is not None],
    }
    for name in LATENCY_METRICS:
        out.update(_stats_ms(name, samples[name], percentiles))
    return out


def missed_targets(
    traces: Sequence[RequestTrace], slos: Optional[SLOs], classes: Sequence[GoodputClass] = ()
) -> set[str]:
    """The client ids of the requests that completed but missed their targets (their class's
    with `classes`, else `slos`): what the timeline marks. Refused requests never ran."""
    by_name = {c.name: c.slos for c in classes}
    out = set()
    for t in traces:
        targets = by_name.get(t.slo_class or "", slos) if classes else slos
        if t.success and t.rid is not None and targets is not None and not targets.met_by(t):
            out.add(t.rid)
    return out


def _stats_ms(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/max/percentiles in ms; 0.0 for an empty sample, as vLLM reports it."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"max_{name}_ms": float(ms.max()),
    }
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def per_request_fields(traces: Sequence[RequestTrace]) -> dict[str, list]:
    """The per-request arrays vLLM also writes (input_lens, output_lens, ttfts, itls, errors)."""
    return {
        "input_lens": [t.prompt_len for t in traces],
        "output_lens": [t.output_len for t in traces],
        "ttfts": [t.ttft for t in traces],
        "e2els": [t.latency for t in traces],
        "itls": [list(t.itls) for t in traces],
        "errors": [t.error for t in traces],
    }
