"""The router's preference for a request with latency targets (TTFT, TPOT): an engine predicted
to meet them, from what each engine reports with its load under `--policy slo` (EngineReady,
once per heartbeat; docs/protocol.md §4.1), never from a guess of its configuration.

An engine's report: the wait a request arriving then would have before its prefill starts
(`queue_s`), the admission rate that wait comes from, the decode step a new row would join and
the prompt tokens per second of a full chunk beside its batch. The frontend adds what it sent
the engine since the report (each one more ahead in its queue, at the reported rate) and the
request's own prefill. Engines predicted to miss are passed over while another is not; an engine
that reports nothing (another policy, no fit yet) is not predicted to miss. The router's usual
rule then chooses among those left, so with no targets, no reports or every engine predicted to
miss, the choice is today's. A request's targets are its own over its class's over the default
class's, from the class table the engines report (`request_targets`), as the engine resolves
them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from shared.protocol.client_channel.messages import LatencyTargets
from shared.protocol.client_channel.targets import TTFT_HEADROOM
from shared.protocol.engine_channel import ClassTargets, SubmitRequest


@dataclass(frozen=True, slots=True)
class LatencyReport:
    """What one engine last predicted for a new request (EngineReady's `slo_*` fields)."""

    queue_s: Optional[float] = None
    admission_rate: Optional[float] = None
    decode_step_s: Optional[float] = None
    prefill_tokens_per_s: Optional[float] = None


def request_targets(
    submit: SubmitRequest, classes: dict[str, ClassTargets], default_class: Optional[str]
) -> Optional[LatencyTargets]:
    """The targets a request is routed by: its own over its class's (the engines' table as they
    report it, EngineReady) over the default class's, as the engine resolves them
    (services/scheduler/slo_classes.py); None when it has none. A class the table lacks adds
    nothing (the engine refuses it)."""
    name = submit.slo_class if submit.slo_class is not None else default_class
    base = classes.get(name, ClassTargets()) if name is not None else ClassTargets()
    ttft_ms = submit.ttft_ms if submit.ttft_ms is not None else base.ttft_ms
    tpot_ms = submit.tpot_ms if submit.tpot_ms is not None else base.tpot_ms
    if ttft_ms is None and tpot_ms is None:
        return None
    return LatencyTargets(ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def predicted_ttft_s(
    report: LatencyReport, num_sent_since: int, prompt_len: int
) -> Optional[float]:
    """Seconds to a new request's first token on the reporting engine, or None when it reported
    no wait. `num_sent_since`: requests this frontend sent it after the report (queued ahead)."""
    if report.queue_s is None:
        return None
    queue_s = report.queue_s
    if num_sent_since > 0:
        rate = report.admission_rate
        if rate is not None:
            queue_s += num_sent_since / rate if rate > 0 else math.inf
    if report.prefill_tokens_per_s:
        queue_s += prompt_len / report.prefill_tokens_per_s
    return queue_s


def predicted_miss(
    report: Optional[LatencyReport], num_sent_since: int, prompt_len: int, targets: LatencyTargets
) -> bool:
    """True when the engine's report predicts the request misses a target; False when it
    predicts both met or cannot tell."""
    if report is None:
        return False
    step = report.decode_step_s
    if targets.tpot_ms is not None and step is not None and step * 1000.0 > targets.tpot_ms:
        return True
    if targets.ttft_ms is None:
        return False
    ttft = predicted_ttft_s(report, num_sent_since, prompt_len)
    return ttft is not None and ttft * 1000.0 > targets.ttft_ms * TTFT_HEADROOM


def engines_to_consider(
    ready: Sequence[int],
    reports: Sequence[Optional[LatencyReport]],
    num_sent_since: Sequence[int],
    prompt_len: int,
    targets: Optional[LatencyTargets],
) -> Sequence[int]:
    """The ready engines not predicted to miss `targets` (indexes into `reports` and
    `num_sent_since`); all of `ready` when there are no targets or none is left."""
    if targets is None or (targets.ttft_ms is None and targets.tpot_ms is None):
        return ready
    kept = [
        e for e in ready if not predicted_miss(reports[e], num_sent_since[e], prompt_len, targets)
    ]
    return kept or ready
