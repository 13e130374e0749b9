"""Goodput classes in a run (`conveyor bench --goodput NAME=ttft:MS,tpot:MS[,share:F] ...`):
each workload request gets a class by share, and its class's targets travel with it
(`ttft_ms`, `tpot_ms`, `on_slo_miss`: docs/protocol.md §3.3), so an engine run with `--policy
slo` can act on them while every other policy ignores them; the goodput then holds each
request to its own class's targets, and a refused request is a miss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from conveyor.bench.metrics import GoodputClass, class_of
from conveyor.bench.workloads import BenchRequest


def with_classes(
    requests: list[BenchRequest], classes: Sequence[GoodputClass]
) -> list[BenchRequest]:
    """The requests, each with its class (unchanged without classes)."""
    if not classes:
        return requests
    return [replace(r, slo_class=class_of(r.index, classes)) for r in requests]


def class_targets(classes: Sequence[GoodputClass], on_slo_miss: str) -> dict[str, dict[str, Any]]:
    """Per class, the fields its requests carry."""
    out = {}
    for c in classes:
        fields: dict[str, Any] = {"on_slo_miss": on_slo_miss}
        if c.slos.ttft_ms is not None:
            fields["ttft_ms"] = c.slos.ttft_ms
        if c.slos.tpot_ms is not None:
            fields["tpot_ms"] = c.slos.tpot_ms
        out[c.name] = fields
    return out
