"""`conveyor bench --compare`: the flags make one comparison, and its table (measured ratios
beside the analytical model's for batching; the latency columns for any setting). The runs
themselves: tests/e2e/test_bench_run.py."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from conveyor.bench.analytical import predict
from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import SamplingChoice
from conveyor.bench.cli import build_parser
from conveyor.bench.compare import comparison_rows
from conveyor.bench.compare_plan import Comparison, Scenario, comparison_from_args
from conveyor.bench.workloads import WorkloadConfig, generate


def _run(tput: float, step_ms: float) -> dict:
    return {
        "completed": 4,
        "output_throughput": tput,
        "total_token_throughput": 2 * tput,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 300.0,
        "median_tpot_ms": 20.0,
        "p99_tpot_ms": 40.0,
        "p99_itl_ms": 50.0,
        "max_itl_ms": 80.0,
        "mean_batch_utilization": 0.5,
        "useful_slot_fraction": 0.4,
        "num_steps": 10.0,
        "mean_step_ms": step_ms,
    }


def _comparison(field: str, values: list[str], batch_size: Optional[int]) -> Any:
    wl = WorkloadConfig(name="mixed", num_prompts=6, seed=4)
    scenario = Scenario("mixed", wl, ArrivalConfig(), SamplingChoice(ignore_eos=True))
    return Comparison(field, values, [scenario], batch_size)


def test_comparison_rows_put_measured_and_predicted_ratios_side_by_side() -> None:
    comparison = _comparison("batching", ["static", "dynamic", "continuous"], 2)
    lens = [r.max_tokens for r in generate(comparison.scenarios[0].workload)]
    runs = {
        "mixed": {
            "static": _run(100.0, 20.0),
            "dynamic": _run(150.0, 20.0),
            "continuous": _run(250.0, 10.0),
        }
    }
    rows = comparison_rows(comparison, runs)
    assert [r["batching"] for r in rows] == ["static", "dynamic", "continuous"]
    assert [r["x static"] for r in rows] == [1.0, 1.5, 2.5]
    assert rows[0]["model x"] is None and rows[1]["model x"] is None
    expected = predict(lens, 2, 0.020, 0.010)
    assert rows[2]["model x"] == pytest.approx(expected.ratio_queue_limited)
    assert rows[2]["packing x"] == pytest.approx(expected.ratio_packing)
    assert rows[2]["TTFT p99 s"] == pytest.approx(0.3) and rows[2]["ITL max ms"] == 80.0


def test_any_other_setting_gets_the_latency_table_against_its_first_value() -> None:
    comparison = _comparison("step_composition", ["mixed", "decode-first"], None)
    runs = {"mixed": {"mixed": _run(100.0, 20.0), "decode-first": _run(80.0, 10.0)}}
    rows = comparison_rows(comparison, runs)
    assert [r["step_composition"] for r in rows] == ["mixed", "decode-first"]
    assert [r["x mixed"] for r in rows] == [1.0, 0.8]
    assert list(rows[0])[:4] == ["scenario", "step_composition", "done", "out tok/s"]
    assert {"TTFT p50 s", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms"} <= set(rows[0])
    assert "model x" not in rows[0]  # the analytical columns are the batching comparison's


def _args(argv: list[str]) -> Any:
    return build_parser().parse_args(argv)


def test_compare_flags_make_one_comparison() -> None:
    flags_run = _comparison("x", ["a"], None).scenarios[0]
    c = comparison_from_args(_args(["--compare", "step-composition=mixed,decode-first"]), flags_run)
    assert (c.field, c.values, c.batch_size) == (
        "step_composition",
        ["mixed", "decode-first"],
        None,
    )
    assert c.scenarios == [flags_run]  # no scenario named: the workload flags' run
    alias = comparison_from_args(_args(["--compare-batching", "--modes", "static,continuous"]),
                                 flags_run)  # fmt: skip
    assert (alias.field, alias.values, alias.batch_size) == (
        "batching",
        ["static", "continuous"],
        16,
    )
    assert [s.name for s in alias.scenarios] == ["uniform", "mixed", "high-concurrency"]
    argv = ["--compare", "max_num_seqs=8,16", "--scenarios", "mixed", "--num-prompts", "64"]
    named = comparison_from_args(_args(argv), flags_run)
    assert named.scenarios[0].workload.num_prompts == 64 and named.scenarios[0].sampling.ignore_eos
    for bad in (["--compare", "step_composition"], ["--compare", "a=x,x"],
                ["--compare", "a=x", "--compare-batching"], []):  # fmt: skip
        with pytest.raises(ValueError):
            comparison_from_args(_args(bad), flags_run)
