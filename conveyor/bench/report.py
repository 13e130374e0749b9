"""What the benchmark prints and writes: a progress bar on stderr while it runs, a table at the
end, the JSON results."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

import orjson

from conveyor.bench.metrics import LATENCY_METRICS, Number, percentile_key

_LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
WIDTH = 56


class ProgressBar:
    """A one-line bar on a stream (stderr): redrawn at most 10 times a second, and at the end."""

    def __init__(self, total: int, label: str = "bench", stream: Optional[TextIO] = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.failed = 0
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def advance(self, success: bool) -> None:
        """Called once per finished request (success or not)."""
        self.done += 1
        self.failed += 0 if success else 1
        now = time.monotonic()
        # Into a file or a pipe, only the final state: no wall of carriage returns in logs.
        redraw = self._tty and now - self._last_draw >= 0.1
        if self.done == self.total or redraw:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, now: float) -> None:
        filled = int(30 * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (30 - filled)
        fail = f" {self.failed} failed" if self.failed else ""
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total}{fail} {now - self._started:.1f}s"
        )
        self.stream.flush()


def format_result(result: Mapping[str, object], percentiles: Sequence[float]) -> str:
    """The console table of one run, in the layout users of `vllm bench serve` know."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]
    _row(lines, "Successful requests:", result.get("completed"))
    _row(lines, "Failed requests:", result.get("failed"))
    _row(lines, "Benchmark duration (s):", result.get("duration"))
    _row(lines, "Total input tokens:", result.get("total_input_tokens"))
    _row(lines, "Total generated tokens:", result.get("total_output_tokens"))
    _row(lines, "Request throughput (req/s):", result.get("request_throughput"))
    if result.get("request_goodput") is not None:
        _row(lines, "Request goodput (req/s):", result.get("request_goodput"))
    _row(lines, "Output token throughput (tok/s):", result.get("output_throughput"))
    _row(lines, "Total Token throughput (tok/s):", result.get("total_token_throughput"))
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^{n}}".format(s=f" {_LATENCY_TITLES[name]} ", n=WIDTH, c="-"))
        _row(lines, f"Mean {name.upper()} (ms):", result.get(f"mean_{name}_ms"))
        _row(lines, f"Median {name.upper()} (ms):", result.get(f"median_{name}_ms"))
        for p in percentiles:
            key = percentile_key(p)
            _row(lines, f"P{key[1:]} {name.upper()} (ms):", result.get(f"{key}_{name}_ms"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _row(lines: list[str], label: str, value: object) -> None:
    if isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = "-" if value is None else str(value)
    lines.append(f"{label:<40}{text:>16}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Number | str]]) -> str:
    """A plain aligned table (used by --compare-batching and sweeps)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out.extend("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)
    return "\n".join(out)


def _cell(value: Number | str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON (numpy values included), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
