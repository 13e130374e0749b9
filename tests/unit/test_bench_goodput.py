"""`conveyor bench --goodput` with classes (issue 33): requests get classes by share, carry their
class's targets, and the goodput holds each to its own class's; a refusal is a miss."""

from __future__ import annotations

import pytest

from conveyor.bench.goodput import class_targets, with_classes
from conveyor.bench.metrics import RequestTrace, SLOs, compute_metrics, parse_goodput
from conveyor.bench.workloads import BenchRequest


def test_classes_parse_split_by_share_and_carry_their_targets() -> None:
    slos, classes = parse_goodput(["fast=ttft:2000,tpot:50,share:3", "slow=ttft:20000"])
    assert slos is None and [c.name for c in classes] == ["fast", "slow"]
    assert classes[0].slos == SLOs(ttft_ms=2000.0, tpot_ms=50.0) and classes[0].share == 3.0
    assert parse_goodput(["ttft:200"]) == (SLOs(ttft_ms=200.0), [])
    for bad in (["fast=ttft:1", "ttft:2"], ["=ttft:1"], ["x=share:2"], ["x=ttft:1,share:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    requests = with_classes([BenchRequest(i, [1, 2], 4) for i in range(400)], classes)
    num_fast = sum(r.slo_class == "fast" for r in requests)
    assert 0.65 < num_fast / 400 < 0.85  # share 3 of 4
    targets = class_targets(classes, "reject")
    assert targets["fast"] == {"ttft_ms": 2000.0, "tpot_ms": 50.0, "on_slo_miss": "reject"}
    assert targets["slow"] == {"ttft_ms": 20000.0, "on_slo_miss": "reject"}


def test_goodput_holds_each_request_to_its_class_and_refusals_miss() -> None:
    _, classes = parse_goodput(["fast=ttft:100", "slow=ttft:1000"])

    def done(i: int, cls: str, ttft: float) -> RequestTrace:
        return RequestTrace(i, 4, True, 3, ttft=ttft, latency=ttft + 0.1, slo_class=cls)

    traces = [
        done(0, "fast", 0.05),  # met
        done(1, "fast", 0.5),  # missed: 500 ms > 100 ms
        done(2, "slow", 0.5),  # met: 500 ms <= 1000 ms
        RequestTrace(3, 4, False, error="slo_unattainable: out of reach", slo_class="fast"),
        RequestTrace(4, 4, False, latency=0.012, error="slo_unattainable: x", slo_class="fast"),
    ]
    out = compute_metrics(traces, duration_s=2.0, classes=classes)
    assert out["request_goodput"] == 1.0  # 2 met in 2 s
    assert out["num_refused"] == 2 and out["failed"] == 2
    assert out["met_share_of_admitted"] == pytest.approx(2 / 3)
    assert out["max_refusal_ms"] == pytest.approx(12.0)  # send to refusal, where it was timed
