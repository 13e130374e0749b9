"""The scheduler's step log read back, request spans, and the pictures drawn from them.

Runtime ~5-20 s (matplotlib's import and PNG rendering on a shared 2-core machine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from conveyor.bench.metrics import RequestTrace
from conveyor.bench.plots import plot_latency_cdfs, plot_sweep, plot_timeline
from conveyor.bench.steplog import (
    engine_view,
    match_rids,
    read_rid_map,
    read_step_log,
    request_spans,
    step_summary,
    useful_slot_fraction,
    with_step_columns,
)
from services.scheduler.stats import StepRecord
from services.scheduler.step_log import StepLogColumns
from shared.protocol.worker_channel import DraftOutcome, PlanDrafts, StepPlan, StepResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Two slots. A: 2 prefill chunks then 3 decodes (4 outputs). B: one chunk then 1 decode
# (2 outputs) and one padding step (static keeps its slot). C arrives late and joins when B leaves.
SCHEDULE = [
    (["fe1:A", "fe1:B"], [True, True]),
    (["fe1:A", "fe1:B"], [True, False]),
    (["fe1:A", "fe1:B"], [False, False]),
    (["fe1:A", "fe1:C"], [False, True]),
    (["fe1:A", "fe1:C"], [False, False]),
]


def write_log(path: Path, t0: float = 1000.0) -> None:
    lines = [orjson.dumps({"event": "engine_ready", "service": "scheduler"})]
    t = t0
    for i, (rids, prefill) in enumerate(SCHEDULE):
        record = {
            "event": "step",
            "service": "scheduler",
            "step_id": i + 1,
            "time": t,
            "rids": rids,
            "num_tokens": len(rids),
            "is_prefill": prefill,
            "num_waiting": 1 if i < 3 else 0,
            "num_running": 2,
            "batch_utilization": 1.0,
            "t_plan": t,
            "t_result": t + 0.1,
        }
        lines.append(orjson.dumps(record))
        t += 0.125
    path.write_bytes(b"\n".join(lines) + b"\n{torn half line")


@pytest.fixture()
def log(tmp_path: Path) -> Path:
    path = tmp_path / "scheduler.log"
    write_log(path)
    return path


def test_read_step_log_parses_steps_and_skips_other_lines(log: Path) -> None:
    steps = read_step_log(log)
    assert [s.step_id for s in steps] == [1, 2, 3, 4, 5]
    assert steps[0].rids == ("fe1:A", "fe1:B") and steps[0].is_prefill == (True, True)
    assert steps[2].is_decode_only and not steps[3].is_decode_only
    assert steps[0].step_s == pytest.approx(0.1)
    assert [s.step_id for s in read_step_log(log, since=1000.2, until=1000.4)] == [3, 4]
    assert read_step_log(log.parent / "missing.log") == []


def test_spans_split_prefill_decode_and_static_padding(log: Path) -> None:
    steps = read_step_log(log)
    spans = {s.rid: s for s in request_spans(steps, {"fe1:C": 1000.05}, {"fe1:A": 4, "fe1:B": 2})}
    a, b, c = spans["fe1:A"], spans["fe1:B"], spans["fe1:C"]
    assert (len(a.prefill), len(a.decode), len(a.idle)) == (2, 3, 0)
    assert (len(b.prefill), len(b.decode), len(b.idle)) == (1, 1, 1)
    assert c.arrival == 1000.05 and c.first_scheduled == pytest.approx(1000.375)
    assert a.arrival == a.first_scheduled == 1000.0  # no arrival known: no wait bar
    # 10 slot-steps, B's padding step wasted one
    assert useful_slot_fraction(steps, {"fe1:A": 4, "fe1:B": 2}, slots=2) == pytest.approx(0.9)


def test_step_summary(log: Path) -> None:
    s = step_summary(read_step_log(log))
    assert s["num_steps"] == 5
    assert s["mean_step_ms"] == pytest.approx(100.0)
    assert s["mean_num_seqs"] == 2 and s["mean_batch_utilization"] == 1.0
    assert step_summary([])["mean_step_ms"] is None


def test_match_rids_finds_the_client_id_inside_the_engine_rid() -> None:
    got = match_rids(
        ["fe1:bench-3", "bench-31@fe2", "bench-4", "fe1:other"], ["bench-3", "bench-31", "bench-4"]
    )
    assert got == {"fe1:bench-3": "bench-3", "bench-31@fe2": "bench-31", "bench-4": "bench-4"}


def test_timeline_png_has_one_row_per_request(log: Path, tmp_path: Path) -> None:
    steps = read_step_log(log)
    lens_by_id = [("A", 4), ("B", 2), ("C", 2)]
    traces = [
        RequestTrace(i, 8, True, n, start_wall=999.9 + i / 100, ttft=0.2, latency=0.5, rid=rid)
        for i, (rid, n) in enumerate(lens_by_id)
    ]
    arrivals, lens = engine_view(steps, traces)
    assert arrivals == {"fe1:A": 999.9, "fe1:B": 999.91, "fe1:C": 999.92}
    assert lens == {"fe1:A": 4, "fe1:B": 2, "fe1:C": 2}
    rows = plot_timeline(steps, arrivals, tmp_path / "t.png", lens)
    assert rows == 3
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    # only the run's own requests get rows when arrivals are known
    assert plot_timeline(steps, {"fe1:C": 999.92}, tmp_path / "t2.png") == 1


def test_cdf_and_sweep_pngs(tmp_path: Path) -> None:
    traces = [
        RequestTrace(i, 8, True, 4, ttft=0.1 * i, latency=0.2 + 0.1 * i, itls=(0.03, 0.04, 0.05))
        for i in range(1, 6)
    ]
    cdf = plot_latency_cdfs({"run": traces}, tmp_path / "cdf.png")
    assert cdf.read_bytes()[:8] == PNG_MAGIC
    results = [
        {
            "output_throughput": 10.0 * k,
            "total_token_throughput": 30.0 * k,
            "mean_ttft_ms": 5.0 * k,
            "p99_ttft_ms": 9.0 * k,
        }
        for k in (1, 2, 3)
    ]
    sweep = plot_sweep([1, 4, 16], results, "max-concurrency", tmp_path / "sweep.png")
    assert sweep.read_bytes()[:8] == PNG_MAGIC


def test_rid_map_from_the_tokenizer_log_links_engine_rids_to_client_ids(tmp_path: Path) -> None:
    lines = [
        {"event": "request_received", "service": "tokenizer", "rid": "fe-1-0", "client_id": "b-0"},
        {"event": "request_finished", "service": "tokenizer", "rid": "fe-1-0"},
        {"event": "request_received", "service": "tokenizer", "rid": "fe-1-1", "client_id": "b-1"},
    ]
    (tmp_path / "tokenizer.log").write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n{")
    (tmp_path / "tokenizer-2.log").write_bytes(
        orjson.dumps({"event": "request_received", "rid": "fe-2-0", "client_id": "b-2"})
    )
    rid_map = read_rid_map(tmp_path)
    assert rid_map == {"fe-1-0": "b-0", "fe-1-1": "b-1", "fe-2-0": "b-2"}
    steps = read_step_log(write_named_log(tmp_path, ["fe-1-0", "fe-2-0"]))
    traces = [
        RequestTrace(0, 4, True, 3, start_wall=5.0, rid="b-0"),
        RequestTrace(2, 4, False, start_wall=6.0, rid="b-2"),
    ]
    arrivals, lens = engine_view(steps, traces, rid_map)
    assert arrivals == {"fe-1-0": 5.0, "fe-2-0": 6.0}
    assert lens == {"fe-1-0": 3}  # a failed request has no output length


def write_named_log(tmp_path: Path, rids: list[str]) -> Path:
    path = tmp_path / "scheduler.log"
    record = {
        "event": "step",
        "step_id": 1,
        "rids": rids,
        "is_prefill": [True] * len(rids),
        "num_running": len(rids),
        "t_plan": 10.0,
        "t_result": 10.1,
    }
    path.write_bytes(orjson.dumps(record) + b"\n")
    return path


# ---- the compact step line (services/scheduler/step_log.py) ------------------------------------


def _record(step_id: int, rids: list[str], chunks: list[int]) -> StepRecord:
    """Decodes first (one token each), then prefill chunks: the order step.py builds."""
    num_decodes = len(rids) - len(chunks)
    return StepRecord(
        step_id=step_id, time=1000.0 + step_id, rids=rids, num_tokens=[1] * num_decodes + chunks,
        is_prefill=[False] * num_decodes + [True] * len(chunks),
        num_prefill_tokens=sum(chunks), num_decode_tokens=num_decodes, num_waiting=0,
        num_running=len(rids), batch_utilization=0.5, num_kv_blocks_used=3, num_kv_blocks_total=9,
        num_preemptions=0, num_released=0,
    )  # fmt: skip


COMPACT_STEPS = [
    (["a", "b"], [5, 3]),  # two prefill chunks
    (["a", "b"], [2]),  # a decodes, b's last chunk
    (["a", "b"], []),  # steady: the same rids (written once, referred to after)
    (["a", "b"], []),
    (["a", "c"], [4]),  # b left, c joined: written again
    (["a", "c"], []),
]


def _write_compact(path: Path, skip_first: bool = False) -> list[StepRecord]:
    columns = StepLogColumns()
    records = [_record(i + 1, list(rids), chunks) for i, (rids, chunks) in enumerate(COMPACT_STEPS)]
    lines = [orjson.dumps({"event": "engine_ready", "service": "scheduler"})]
    for rec in records:
        fields = columns.fields(rec)
        fields.update(event="step", t_plan=rec.time, t_result=rec.time + 0.5)
        lines.append(orjson.dumps(fields))
    path.write_bytes(b"\n".join(lines[2:] if skip_first else lines) + b"\n")
    return records


def test_compact_step_lines_read_back_as_the_records(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.log"
    records = _write_compact(path)
    raw = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [("rids" in r, r.get("rids_as_step")) for r in raw[1:]] == [
        (True, None), (False, 1), (False, 1), (False, 1), (True, None), (False, 5),
    ]  # fmt: skip
    assert all("is_prefill" not in r and "num_tokens" not in r for r in raw)
    steps = read_step_log(path)
    assert [(list(s.rids), list(s.is_prefill), s.num_tokens) for s in steps] == [
        (r.rids, r.is_prefill, sum(r.num_tokens)) for r in records
    ]
    completed = [r for r in with_step_columns(raw) if r.get("event") == "step"]
    assert [(c["rids"], c["num_tokens"], c["is_prefill"]) for c in completed] == [
        (r.rids, r.num_tokens, r.is_prefill) for r in records
    ]


def test_a_cut_step_log_leaves_out_lines_whose_rids_it_lost(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.log"
    _write_compact(path, skip_first=True)  # step 1's line (which wrote a, b) is gone
    assert [s.step_id for s in read_step_log(path)] == [5, 6]


def test_step_lines_of_two_engines_mixed_in_one_file_keep_their_own_rids(tmp_path: Path) -> None:
    """Two engines' lines interleaved (one stream for both): each refers to its own lines,
    even where their step ids coincide."""
    a, b = StepLogColumns(), StepLogColumns()
    lines = []
    for step_id in (1, 2, 3):
        for engine, columns, rids in (("0", a, ["x", "y"]), ("1", b, ["z"])):
            fields = columns.fields(_record(step_id, rids, []))
            fields.update(event="step", engine=engine, t_plan=float(step_id))
            lines.append(fields)
    completed = list(with_step_columns(lines))
    assert [(c["engine"], c["rids"]) for c in completed] == [
        ("0", ["x", "y"]), ("1", ["z"]), ("0", ["x", "y"]), ("1", ["z"]),
        ("0", ["x", "y"]), ("1", ["z"]),
    ]  # fmt: skip


def test_a_step_line_carries_the_steps_drafts() -> None:
    """With speculation the line says what the plan allowed and what the result accepted;
    without draft limits it has no draft columns."""
    record = _record(1, ["a", "b", "c"], [])
    plan = StepPlan(step_id=1, prev_step_id=0, num_seqs=3, num_scheduled_tokens=3,
                    drafts=PlanDrafts(slots=[0, 2], limits=[4, 3]))  # fmt: skip
    outcome = DraftOutcome(rows=[0, 2], proposed=[4, 2], accepted=[3, 0], token_ids=[7, 8, 9])
    result = StepResult(step_id=1, token_ids=[1, 2, 3], drafts=outcome)
    fields = StepLogColumns().fields(record, plan, result)
    assert (fields["draft_limit"], fields["num_draft_rows"]) == (7, 2)
    assert (fields["num_draft_tokens"], fields["num_accepted_tokens"]) == (6, 3)
    nothing = StepLogColumns().fields(record, plan, StepResult(step_id=1, token_ids=[1, 2, 3]))
    assert (nothing["num_draft_tokens"], nothing["num_accepted_tokens"]) == (0, 0)
    plain = dataclasses.replace(plan, drafts=None)
    assert "draft_limit" not in StepLogColumns().fields(record, plain, result)
