"""Bench metrics from a hand-made trace whose answers are worked out by hand."""

from __future__ import annotations

import math

import pytest

from conveyor.bench.metrics import (
    RequestTrace,
    SLOs,
    compute_metrics,
    parse_slos,
    per_request_fields,
    percentile_key,
)

# Three requests over a 2-second run:
#   A: 10 prompt tokens, 5 output tokens, TTFT 0.1 s, E2EL 0.5 s, gaps 0.1 each (4 gaps)
#   B: 20 prompt tokens, 3 output tokens, TTFT 0.3 s, E2EL 0.7 s, gaps 0.2, 0.2
#   C: failed
A = RequestTrace(0, 10, True, 5, ttft=0.1, latency=0.5, itls=(0.1, 0.1, 0.1, 0.1))
B = RequestTrace(1, 20, True, 3, ttft=0.3, latency=0.7, itls=(0.2, 0.2))
C = RequestTrace(2, 30, False, error="engine_error: boom")


def test_counts_and_throughputs() -> None:
    m = compute_metrics([A, B, C], duration_s=2.0)
    assert m["completed"] == 2
    assert m["failed"] == 1
    assert m["total_input_tokens"] == 30  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["request_goodput"] is None
    assert m["duration"] == 2.0


def test_latency_statistics() -> None:
    m = compute_metrics([A, B, C], duration_s=2.0, percentiles=(50, 90, 99))
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(100.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation between 100 and 300
    # TPOT: A (0.5 - 0.1) / 4 = 0.1 s, B (0.7 - 0.3) / 2 = 0.2 s
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_tpot_ms"] == pytest.approx(199.0)
    # ITL pooled: four of 100 ms, two of 200 ms
    assert m["mean_itl_ms"] == pytest.approx(800.0 / 6)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["p99_e2el_ms"] == pytest.approx(698.0)


def test_goodput_counts_requests_within_every_slo() -> None:
    # A meets TTFT 150 ms and TPOT 150 ms, B misses the TTFT one; C failed.
    m = compute_metrics([A, B, C], duration_s=2.0, slos=SLOs(ttft_ms=150, tpot_ms=150))
    assert m["request_goodput"] == pytest.approx(0.5)
    m = compute_metrics([A, B, C], duration_s=2.0, slos=SLOs(e2el_ms=1000))
    assert m["request_goodput"] == pytest.approx(1.0)


def test_single_token_output_has_no_tpot_and_no_itl() -> None:
    one = RequestTrace(0, 4, True, 1, ttft=0.05, latency=0.05)
    assert one.tpot is None
    m = compute_metrics([one], duration_s=1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(50.0)


def test_vllm_field_names_present() -> None:
    m = compute_metrics([A, B], duration_s=1.0)
    names = [
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        names += [f"{s}_{metric}_ms" for s in ("mean", "median", "std", "p90", "p99")]
    assert not [n for n in names if n not in m]
    assert all(isinstance(m[n], (int, float)) and math.isfinite(m[n]) for n in names)


def test_per_request_fields() -> None:
    f = per_request_fields([A, C])
    assert f["input_lens"] == [10, 30]
    assert f["output_lens"] == [5, 0]
    assert f["ttfts"] == [0.1, None]
    assert f["errors"] == ["", "engine_error: boom"]


def test_parse_slos_and_percentile_keys() -> None:
    assert parse_slos(["ttft:200", "e2el:1500"]) == SLOs(ttft_ms=200, e2el_ms=1500)
    assert parse_slos([]) is None
    with pytest.raises(ValueError):
        parse_slos(["latency:3"])
    with pytest.raises(ValueError):
        parse_slos(["ttft:-1"])
    assert percentile_key(99.0) == "p99"
    assert percentile_key(99.9) == "p99.9"


def test_duration_must_be_positive() -> None:
    with pytest.raises(ValueError):
        compute_metrics([A], duration_s=0.0)
