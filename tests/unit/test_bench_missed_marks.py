"""The benchmark's timeline marks the requests that missed their latency targets (issue 33):
which ones missed (each held to its class's targets; a refused one never ran), and the red
marks on the rows of those, and of no other."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from conveyor.bench.metrics import RequestTrace, missed_targets, parse_goodput  # noqa: E402
from conveyor.bench.plots import MISSED_COLOR, mark_missed  # noqa: E402
from conveyor.bench.steplog import RequestSpans  # noqa: E402


def _done(i: int, cls: str, ttft: float) -> RequestTrace:
    return RequestTrace(i, 4, True, 3, ttft=ttft, latency=ttft + 0.1, rid=f"c{i}", slo_class=cls)


def test_the_requests_that_missed_their_own_class_targets() -> None:
    slos, classes = parse_goodput(["fast=ttft:100", "slow=ttft:1000"])
    traces = [
        _done(0, "fast", 0.05),  # met
        _done(1, "fast", 0.5),  # missed: 500 ms > 100 ms
        _done(2, "slow", 0.5),  # met: 500 ms <= 1000 ms
        RequestTrace(
            3, 4, False, error="slo_unattainable: out of reach", rid="c3", slo_class="fast"
        ),  # fmt: skip
    ]
    assert missed_targets(traces, slos, classes) == {"c1"}
    one_slo, no_classes = parse_goodput(["ttft:100"])
    assert missed_targets(traces, one_slo, no_classes) == {"c1", "c2"}
    assert missed_targets(traces, None) == set()


def test_the_timeline_marks_the_rows_that_missed_and_no_other() -> None:
    spans = [RequestSpans(f"e{i}", 0.0, 0.1 * i, decode=[(0.1 * i, 0.1 * i + 0.5)])
             for i in range(4)]  # fmt: skip
    fig, ax = plt.subplots()
    ax.set_yticks(range(4))
    ax.set_yticklabels([s.rid for s in reversed(spans)])
    assert mark_missed(ax, spans, {"e1", "e3"}, 0.0) == 2
    red = {label.get_text() for label in ax.get_yticklabels() if label.get_color() == MISSED_COLOR}
    assert red == {"e1", "e3"}
    marks = [line.get_xydata()[0].tolist() for line in ax.get_lines()]
    # each at its last step's end, on its row
    assert sorted(marks) == [pytest.approx([0.6, 2.0]), pytest.approx([0.8, 0.0])]
    plt.close(fig)
