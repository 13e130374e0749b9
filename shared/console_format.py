"""One log record -> one short human line: time, service, level, event, the fields that matter.

Used twice: by a service that writes to a terminal itself (`--log-format console`) and by
`conveyor up`, which reads its services' JSON lines and shows them this way (conveyor/console.py).
Files and log collectors always get the JSON record; this is only what a person reads.

    12:04:05.123 scheduler  INFO  request_finished rid=r-1 finish_reason=stop num_output_tokens=16
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Literal, Optional, get_args

LogFormat = Literal["console", "json", "auto"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)

# Keys the head of the line already shows, or that only machines read.
_HEAD = ("ts", "service", "level", "event")
_NOISE = frozenset({"rids", "num_tokens", "is_prefill", "time", "t_plan", "t_result", "rank",
                    "exception"})  # fmt: skip
MAX_FIELDS = 8  # fields beyond these are left to the JSON log
MAX_VALUE_LEN = 60

# Events whose useful fields are known: shown in this order, the rest left out.
_PICKED: dict[str, tuple[str, ...]] = {
    "step": ("step_id", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_waiting",
             "num_kv_blocks_used", "step_s", "forward_s"),
    "request_admitted": ("rid", "num_prompt_tokens"),
    "request_finished": ("rid", "finish_reason", "num_output_tokens", "error_code", "ttft_s",
                         "tpot_s", "e2e_s"),
    "worker_ready": ("rank", "model_name", "num_blocks", "block_size", "max_model_len", "dtype",
                     "device"),
}  # fmt: skip

_LEVEL_COLOUR = {
    "debug": "\x1b[2m",
    "info": "\x1b[32m",
    "warning": "\x1b[33m",
    "error": "\x1b[31;1m",
    "critical": "\x1b[31;1m",
}
_DIM, _BOLD, _CYAN, _RESET = "\x1b[2m", "\x1b[1m", "\x1b[36m", "\x1b[0m"


def render(record: Mapping[str, Any], colour: bool = False) -> str:
    """The console line of one JSON log record (never raises on odd records)."""
    event = str(record.get("event", "-"))
    level = str(record.get("level", "info")).lower()
    service = str(record.get("service", "-"))
    clock = _clock(record.get("ts"))
    body = summary_text(record) if event == "engine_summary" else _fields(event, record)
    # A traceback is shown whole, below its line: it is what a person reads the line for.
    trace = record.get("exception")
    tail = "\n" + str(trace).rstrip() if trace else ""
    if not colour:
        return f"{clock} {service:<9} {level.upper():<5} {event} {body}".rstrip() + tail
    tint = _LEVEL_COLOUR.get(level, "")
    name = f"{_BOLD}{event}{_RESET}"
    return (f"{_DIM}{clock}{_RESET} {_CYAN}{service:<9}{_RESET} {tint}{level.upper():<5}{_RESET}"
            f" {name} {body}").rstrip() + tail  # fmt: skip


def render_text(service: str, text: str, colour: bool = False, level: str = "info") -> str:
    """A line that is not a JSON record (a traceback line, a launcher note), as a console line."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return render({"ts": now, "service": service, "level": level, "event": text.rstrip()}, colour)


def summary_text(r: Mapping[str, Any]) -> str:
    """The `engine_summary` record as vLLM-style prose."""
    parts = [
        f"prompt {_num(r.get('prompt_tokens_per_s'))} tok/s",
        f"generation {_num(r.get('generation_tokens_per_s'))} tok/s",
        f"running {_int(r.get('num_running'))}",
        f"waiting {_int(r.get('num_waiting'))}",
        f"preempted {_int(r.get('num_preempted'))}",
        f"KV {_num(r.get('kv_usage_pct'))}%",
    ]
    if r.get("prefix_cache_hit_pct") is not None:
        parts.append(f"prefix hit {_num(r.get('prefix_cache_hit_pct'))}%")
    if r.get("draft_acceptance_pct") is not None:
        parts.append(f"drafts accepted {_num(r.get('draft_acceptance_pct'))}%")
    if r.get("step_p50_ms") is not None:
        parts.append(f"step p50 {_num(r.get('step_p50_ms'))} ms")
    return ", ".join(parts)


def _fields(event: str, record: Mapping[str, Any]) -> str:
    keys = _PICKED.get(event)
    if keys is None:
        keys = tuple(k for k in record if k not in _HEAD and k not in _NOISE)
    shown = []
    for key in keys:
        value = record.get(key)
        if value is None:
            continue
        shown.append(f"{key}={_value(value)}")
        if len(shown) == MAX_FIELDS:
            break
    return " ".join(shown)


def _value(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str):
        text = value if value and " " not in value else json.dumps(value)
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= MAX_VALUE_LEN else text[: MAX_VALUE_LEN - 1] + "…"


def _clock(ts: Any) -> str:
    """'2026-12-01T01:02:03.456789Z' -> '01:02:03.456' (UTC, as the JSON logs)."""
    if isinstance(ts, str) and "T" in ts:
        return ts.split("T", 1)[1][:12].rstrip("Z").ljust(12, "0")
    return "--:--:--.---"


def _num(value: Optional[Any]) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def _int(value: Optional[Any]) -> str:
    return str(int(value)) if isinstance(value, (int, float)) else "-"
