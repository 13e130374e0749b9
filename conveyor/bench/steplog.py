"""The scheduler's step log read back: what ran in each step, and each request's spans.

The scheduler process writes one JSON line per step to `logs/scheduler.log` with event "step":
the fields of `services.scheduler.stats.StepRecord` (rids, is_prefill, num_running,
num_waiting, batch_utilization, ...) plus the server's timing fields (t_plan: plan sent,
t_result: result received, step_s, forward_s). All times are time.time() on the engine's machine,
the same clock the benchmark client stamps its requests with. The per-request lists are written
compactly (services/scheduler/step_log.py): `with_step_columns` restores them, reading the
lines of one log file in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import orjson

from conveyor.bench.metrics import RequestTrace


@dataclass(frozen=True, slots=True)
class StepEntry:
    """One step as the log tells it; rids and is_prefill are parallel, in batch order."""

    step_id: int
    t_plan: float
    t_result: float
    rids: tuple[str, ...]
    is_prefill: tuple[bool, ...]
    num_tokens: int
    num_running: int
    num_waiting: Optional[int] = None
    batch_utilization: Optional[float] = None
    forward_s: Optional[float] = None
    gap_s: Optional[float] = None  # previous result -> this plan, on the scheduler's side

    @property
    def num_seqs(self) -> int:
        return len(self.rids)

    @property
    def step_s(self) -> float:
        return self.t_result - self.t_plan

    @property
    def is_decode_only(self) -> bool:
        return not any(self.is_prefill)


@dataclass(slots=True)
class RequestSpans:
    """One request's life on the engine: [start, end) intervals in time.time() seconds."""

    rid: str
    arrival: float
    first_scheduled: Optional[float] = None
    prefill: list[tuple[float, float]] = field(default_factory=list)
    decode: list[tuple[float, float]] = field(default_factory=list)
    idle: list[tuple[float, float]] = field(default_factory=list)  # static padding after its end


class StepColumns:
    """Restores the per-request lists of step lines read in file order: `rids` from the line
    that `rids_as_step` names (the last one of the same engine that wrote them), `num_tokens`
    and `is_prefill` from `num_decodes` and `chunk_num_tokens`. Lines in the full form pass as
    they are. Keyed by the lines' `engine`, so the lines of several engines may be mixed."""

    def __init__(self) -> None:
        self._rids: dict[Any, tuple[Any, list[Any]]] = {}  # engine -> (step_id, rids)

    def complete(self, obj: dict[str, Any]) -> Optional[dict[str, Any]]:
        """`obj` with its lists (a new dict), `obj` itself if it is not a compact step line,
        or None for a step line whose rids were written by a line not read (a cut log)."""
        if obj.get("event") != "step" or "num_decodes" not in obj:
            return obj
        out = dict(obj)
        engine = obj.get("engine")
        if "rids" in obj:
            self._rids[engine] = (obj.get("step_id"), obj["rids"])
        else:
            step_id, rids = self._rids.get(engine, (None, []))
            if step_id is None or obj.get("rids_as_step") != step_id:
                return None
            out["rids"] = rids
        num_decodes = int(obj["num_decodes"])
        chunks = list(obj.get("chunk_num_tokens") or [])
        out["num_tokens"] = [1] * num_decodes + chunks
        out["is_prefill"] = [False] * num_decodes + [True] * len(chunks)
        return out


def with_step_columns(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The records of one log file, in order, with every step line's per-request lists
    (`StepColumns`); a step line whose rids cannot be restored is left out."""
    columns = StepColumns()
    for obj in records:
        done = columns.complete(obj)
        if done is not None:
            yield done


def parse_step_line(obj: Mapping[str, Any]) -> Optional[StepEntry]:
    """A StepEntry from one decoded log line with its per-request lists (`StepColumns`), or
    None when the line is not a step record."""
    if obj.get("event") != "step" or "rids" not in obj:
        return None
    rids = tuple(str(r) for r in obj["rids"])
    is_prefill = tuple(bool(p) for p in obj.get("is_prefill") or [False] * len(rids))
    tokens = obj.get("num_tokens", len(rids))
    # The record's per-sequence list may be replaced by the plan's total in the log line.
    num_tokens = sum(tokens) if isinstance(tokens, list) else int(tokens)
    t_plan = float(obj.get("t_plan", obj.get("time", 0.0)))
    t_result = float(obj.get("t_result", t_plan + float(obj.get("step_s") or 0.0)))
    return StepEntry(
        step_id=int(obj.get("step_id", 0)),
        t_plan=t_plan,
        t_result=t_result,
        rids=rids,
        is_prefill=is_prefill,
        num_tokens=num_tokens,
        num_running=int(obj.get("num_running", len(rids))),
        num_waiting=_opt_int(obj.get("num_waiting")),
        batch_utilization=_opt_float(obj.get("batch_utilization")),
        forward_s=_opt_float(obj.get("forward_s")),
        gap_s=_opt_float(obj.get("gap_s")),
    )


def read_step_log(
    path: Path, since: Optional[float] = None, until: Optional[float] = None
) -> list[StepEntry]:
    """Step entries whose plan was sent in [since, until], in step order. Lines that are not
    JSON (a torn last line while the engine runs) are skipped."""
    if not path.exists():
        return []
    steps = []
    columns = StepColumns()
    with path.open("rb") as f:
        for line in f:
            entry = _parse_bytes(line, columns)
            if entry is None:
                continue
            if since is not None and entry.t_plan < since:
                continue
            if until is not None and entry.t_plan > until:
                continue
            steps.append(entry)
    steps.sort(key=lambda s: s.t_plan)
    return steps


def _parse_bytes(line: bytes, columns: StepColumns) -> Optional[StepEntry]:
    if b'"step"' not in line:  # cheap filter: most lines are other events
        return None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    done = columns.complete(obj)
    return parse_step_line(done) if done is not None else None


def request_spans(
    steps: Sequence[StepEntry],
    arrivals: Mapping[str, float],
    output_lens: Optional[Mapping[str, int]] = None,
) -> list[RequestSpans]:
    """Every request seen in `steps`, with its prefill chunks and decode steps as intervals.

    arrivals: engine rid -> arrival time (when the client sent it); a rid without one is taken
    to arrive when first scheduled. output_lens: engine rid -> output tokens it produced; decode
    steps beyond them are static padding (the request had finished but kept its slot).
    """
    spans: dict[str, RequestSpans] = {}
    decodes_seen: dict[str, int] = {}
    lens = output_lens or {}
    for step in steps:
        interval = (step.t_plan, step.t_result)
        for rid, prefill in zip(step.rids, step.is_prefill, strict=False):
            span = spans.get(rid)
            if span is None:
                span = RequestSpans(rid=rid, arrival=arrivals.get(rid, step.t_plan))
                span.first_scheduled = step.t_plan
                spans[rid] = span
            if prefill:
                span.prefill.append(interval)
                continue
            # The last prefill chunk samples the first output token; decode k samples token k+1.
            decodes_seen[rid] = decodes_seen.get(rid, 0) + 1
            limit = lens.get(rid)
            if limit is not None and decodes_seen[rid] > limit - 1:
                span.idle.append(interval)
            else:
                span.decode.append(interval)
    return list(spans.values())


def match_rids(engine_rids: Iterable[str], client_ids: Iterable[str]) -> dict[str, str]:
    """engine rid -> client id. The frontend makes rids unique by adding its own id to the
    client's, so a client id is the engine rid itself or a part of it cut at a separator."""
    wanted = set(client_ids)
    out: dict[str, str] = {}
    for rid in engine_rids:
        if rid in wanted:
            out[rid] = rid
            continue
        for cut in range(1, len(rid)):
            if rid[cut - 1].isalnum() and rid[cut].isalnum():
                continue
            if rid[cut:] in wanted:  # "<frontend>:<client id>"
                out[rid] = rid[cut:]
                break
            if rid[:cut] in wanted:  # "<client id>@<frontend>"
                out[rid] = rid[:cut]
                break
    return out


def step_summary(steps: Sequence[StepEntry]) -> dict[str, Optional[float]]:
    """Averages the comparison needs: step time (all steps, decode-only steps), sequences per
    step, slots held, batch utilization; and the number of decode rows over all steps."""
    if not steps:
        keys = (
            "num_steps",
            "mean_step_ms",
            "mean_decode_step_ms",
            "mean_num_seqs",
            "mean_num_running",
            "mean_batch_utilization",
            "num_decode_rows",
        )
        return dict.fromkeys(keys)
    decode = [s.step_s for s in steps if s.is_decode_only]
    utils = [s.batch_utilization for s in steps if s.batch_utilization is not None]
    return {
        "num_steps": float(len(steps)),
        "mean_step_ms": 1000.0 * sum(s.step_s for s in steps) / len(steps),
        "mean_decode_step_ms": 1000.0 * sum(decode) / len(decode) if decode else None,
        "mean_num_seqs": sum(s.num_seqs for s in steps) / len(steps),
        "mean_num_running": sum(s.num_running for s in steps) / len(steps),
        "mean_batch_utilization": sum(utils) / len(utils) if utils else None,
        # rows that decoded (not a prompt chunk), in every step: speculation's prediction
        "num_decode_rows": float(sum(s.num_seqs - sum(s.is_prefill) for s in steps)),
    }


def _opt_int(v: Any) -> Optional[int]:
    return None if v is None else int(v)


def _opt_float(v: Any) -> Optional[float]:
    return None if v is None else float(v)


def read_rid_map(log_dir: Path) -> dict[str, str]:
    """engine rid -> client id, from the frontends' `request_received` lines
    (logs/tokenizer*.log: the tokenizer service names both when it accepts a request)."""
    out: dict[str, str] = {}
    for path in sorted(log_dir.glob("tokenizer*.log")):
        with path.open("rb") as f:
            for line in f:
                if b"request_received" not in line:
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict) and obj.get("rid") and obj.get("client_id"):
                    out[str(obj["rid"])] = str(obj["client_id"])
    return out


def engine_rids(
    steps: Sequence[StepEntry],
    traces: Sequence[RequestTrace],
    rid_map: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    """engine rid -> client id, for the traces whose rid the steps mention (`rid_map` from
    `read_rid_map`; rids it does not know are matched by `match_rids`)."""
    by_id = {t.rid: t for t in traces if t.rid is not None}
    seen = {rid for step in steps for rid in step.rids}
    known = {rid: cid for rid, cid in (rid_map or {}).items() if rid in seen and cid in by_id}
    known.update(match_rids(seen - known.keys(), by_id))
    return known


def engine_view(
    steps: Sequence[StepEntry],
    traces: Sequence[RequestTrace],
    rid_map: Optional[Mapping[str, str]] = None,
) -> tuple[dict[str, float], dict[str, int]]:
    """(arrival, output length) per engine rid, for the traces whose rid the steps mention.

    rid_map: engine rid -> client id (see `read_rid_map`); rids it does not know are matched
    by `match_rids` (a client id embedded in the engine rid)."""
    by_id = {t.rid: t for t in traces if t.rid is not None}
    arrivals: dict[str, float] = {}
    output_lens: dict[str, int] = {}
    for engine_rid, client_id in engine_rids(steps, traces, rid_map).items():
        trace = by_id[client_id]
        arrivals[engine_rid] = trace.start_wall
        if trace.success:
            output_lens[engine_rid] = trace.output_len
    return arrivals, output_lens


def useful_slot_fraction(
    steps: Sequence[StepEntry], output_lens: Mapping[str, int], slots: int
) -> Optional[float]:
    """Share of the batch's slots (steps x `slots`) that computed something a user received:
    prefill chunks and decodes up to each request's last token (static padding excluded)."""
    if not steps or slots < 1:
        return None
    spans = request_spans(steps, {}, output_lens)
    useful = sum(len(s.prefill) + len(s.decode) for s in spans)
    return useful / (len(steps) * slots)
