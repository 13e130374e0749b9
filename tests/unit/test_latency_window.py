"""The frontend's last-minute TTFT/TPOT window (services/tokenizer/latency_window.py), against
percentiles computed by hand (nearest rank)."""

from __future__ import annotations

import pytest

from services.tokenizer.latency_window import LatencyWindow, nearest_rank


def test_nearest_rank_matches_the_definition() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100: the q-th percentile is q
    for q in (1, 50, 90, 99, 100):
        assert nearest_rank(values, q) == q
    assert nearest_rank([7.0], 50) == 7.0
    assert nearest_rank([1.0, 2.0, 3.0], 50) == 2.0  # ceil(1.5) = 2nd


def test_window_keeps_one_minute_and_skips_missing_values() -> None:
    window = LatencyWindow(window_s=60.0)
    assert window.percentiles(0.0) == {"num_finished_1m": 0.0}
    window.record(0.0, 9.0, 9.0)  # old: gone by t=100
    for i in range(1, 11):
        window.record(50.0 + i, ttft_s=i / 10, tpot_s=None if i > 5 else i / 100)
    window.check_invariants()
    out = window.percentiles(100.0)
    assert out["num_finished_1m"] == 10.0
    assert out["ttft_p50_s"] == 0.5 and out["ttft_p90_s"] == 0.9 and out["ttft_p99_s"] == 1.0
    assert out["tpot_p50_s"] == 0.03 and out["tpot_p99_s"] == 0.05  # only 5 had a TPOT
    assert window.percentiles(200.0) == {"num_finished_1m": 0.0}
    with pytest.raises(ValueError):
        LatencyWindow(window_s=0)
