"""`conveyor top`: a live view of running engines, refreshed from their `stats` replies.

One column per engine (`--address` may be repeated; a frontend with several engines, data
parallel or prefill and decode apart, shows each of them): its role (colocated, prefill or
decode), requests running and waiting, KV cache use, the KV hand-overs' leases it holds and
the KV it pulled, prompt and generation tokens per second (counter differences between two
refreshes), TTFT and TPOT percentiles over the last minute (the frontend's window, the same for
every engine behind it), requests finished in that minute.
`q` or Ctrl-C quits. Drawn with `rich`; an engine that does not answer shows why in its row and
is asked again at the next refresh.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shared.addresses import default_frontend_address
from shared.curve import add_client_key_flags

QUIT_KEYS = ("q", "Q")


@dataclass(frozen=True)
class EngineView:
    """What one row shows; `error` set when the engine did not answer."""

    address: str
    ready: bool = False
    engine: Optional[dict[str, float]] = None
    frontend: Optional[dict[str, float]] = None
    prompt_tokens_per_s: Optional[float] = None
    generation_tokens_per_s: Optional[float] = None
    error: Optional[str] = None
    role: Optional[str] = None  # colocated, prefill or decode (the frontend's health reply)


class EngineSampler:
    """Polls one engine; keeps the previous counters to turn them into rates."""

    def __init__(
        self,
        address: str,
        timeout: float,
        server_key: Optional[Path] = None,
        client_key: Optional[Path] = None,
    ) -> None:
        """`server_key` / `client_key`: CURVE key files (shared/curve.py), both or neither."""
        from shared.client import Client

        self.address = address
        self._client = Client(address, timeout=timeout, connect_timeout=min(timeout, 1.0),
                              server_key=server_key, client_key=client_key)  # fmt: skip
        self._previous: dict[str, tuple[float, dict[str, float]]] = {}  # by engine name

    def sample(self) -> list[EngineView]:
        """One `health` and one `stats` round trip (each at most `timeout` seconds): one view
        of the frontend's engines together, or one per engine when it has several."""
        from shared.client import EngineError

        try:
            roles = {e.get("engine"): e.get("role") for e in self._client.health()["engines"]}
            reply = self._client.stats()
        except EngineError as exc:
            self._previous.clear()
            return [EngineView(self.address, error=f"{exc.code}: {exc.message}")]
        now = time.monotonic()
        per_engine = reply.get("engines") or {}
        if len(per_engine) < 2:
            role = next(iter(roles.values()), None)
            return [self._view(self.address, "", reply, reply.get("engine") or None, now, role)]
        return [self._view(f"{self.address} #{name}", name, reply, engine or None, now,
                           roles.get(name)) for name, engine in per_engine.items()]  # fmt: skip

    def _view(
        self, label: str, name: str, reply: dict[str, Any], engine: Optional[dict[str, float]],
        now: float, role: Optional[str],
    ) -> EngineView:  # fmt: skip
        rates: dict[str, Optional[float]] = {}
        previous = self._previous.get(name)
        if engine is not None and previous is not None:
            then, before = previous
            elapsed = max(now - then, 1e-6)
            for key, rate in (("num_prefill_tokens", "prompt"), ("num_output_tokens", "gen")):
                grown = engine.get(key, 0.0) - before.get(key, 0.0)
                rates[rate] = max(grown, 0.0) / elapsed
        if engine is not None:
            self._previous[name] = (now, dict(engine))
        else:
            self._previous.pop(name, None)
        return EngineView(
            label,
            ready=bool(reply.get("ready")) and engine is not None,
            engine=engine,
            frontend=reply.get("frontend") or None,
            prompt_tokens_per_s=rates.get("prompt"),
            generation_tokens_per_s=rates.get("gen"),
            role=role,
        )

    def close(self) -> None:
        self._client.close()


# The table's rows, one column per engine (narrow terminals fit several engines this way).
ROWS = ("state", "role", "running", "waiting", "KV use", "KV leases", "KV pulled MB",
        "prompt tok/s", "gen tok/s", "TTFT ms p50/90/99", "TPOT ms p50/90/99",
        "done in 1 min")  # fmt: skip


def render(views: list[EngineView], interval: float) -> Group:
    """The whole screen: a title line, the table, the errors below it."""
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    table.add_column("", style="bold", no_wrap=True)
    for view in views:
        table.add_column(view.address, justify="right", no_wrap=True)
    cells = [_column(view) for view in views]
    for i, name in enumerate(ROWS):
        table.add_row(name, *(column[i] for column in cells))
    title = Text.assemble(("conveyor top", "bold"), f"  refresh {interval:g} s, q quits  ",
                          (time.strftime("%H:%M:%S"), "dim"))  # fmt: skip
    errors = [Text(f"{v.address}: {v.error}", style="red") for v in views if v.error]
    return Group(title, table, *errors)


def _column(view: EngineView) -> tuple[Any, ...]:
    """One engine's cells, in ROWS order."""
    blank = ("",) * (len(ROWS) - 1)
    engine, frontend = view.engine or {}, view.frontend or {}
    if view.error is not None:
        return Text("unreachable", style="red"), *blank
    if not view.ready or not engine:
        return Text("not ready", style="yellow"), *blank
    state = Text("draining", style="yellow") if engine.get("draining") else Text("ready", "green")
    pulled = engine.get("kv_pull_bytes")
    return (state, view.role or "-", _int(engine.get("num_running")),
            _int(engine.get("num_waiting")), f"{100.0 * engine.get('kv_usage', 0.0):.1f}%",
            _int(engine.get("num_leases")), "-" if pulled is None else f"{pulled / 1e6:.1f}",
            _rate(view.prompt_tokens_per_s),
            _rate(view.generation_tokens_per_s), _quantiles(frontend, "ttft"),
            _quantiles(frontend, "tpot"), _int(frontend.get("num_finished_1m")))  # fmt: skip


def _quantiles(frontend: dict[str, float], name: str) -> str:
    values = [frontend.get(f"{name}_p{q}_s") for q in (50, 90, 99)]
    if all(v is None for v in values):
        return "-"
    return "/".join("-" if v is None else f"{1000.0 * v:.0f}" for v in values)


def _int(value: Optional[float]) -> str:
    return "-" if value is None else str(int(value))


def _rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Optional[int]]:
    """cbreak mode on a terminal (single key presses, Ctrl-C still a signal); yields its file
    descriptor, or None when stdin is not a terminal (then only Ctrl-C quits)."""
    if not stream.isatty():
        yield None
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: Optional[int], wait_s: float) -> bool:
    """Wait up to `wait_s` for a key; True when it was a quit key."""
    if fd is None:
        time.sleep(wait_s)
        return False
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            if os.read(fd, 1).decode(errors="replace") in QUIT_KEYS:
                return True
    return False


def add_top_command(sub: Any) -> None:
    p = sub.add_parser("top", help="live view of running engines (q quits)")
    p.add_argument("--address", action="append",
                   help="a frontend; repeat it for several engines (default: `up`'s)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds to wait for one engine's stats reply")  # fmt: skip
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    add_client_key_flags(p)
    p.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.timeout <= 0:
        print("conveyor: --interval and --timeout must be > 0", file=sys.stderr)
        return 2
    addresses = args.address or [default_frontend_address()]
    try:
        samplers = [
            EngineSampler(a, args.timeout, args.server_key, args.client_key) for a in addresses
        ]
    except ValueError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    console = Console()
    try:
        if args.once:
            console.print(render([v for s in samplers for v in s.sample()], args.interval))
            return 0
        with _keys(sys.stdin) as fd, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                views = [v for s in samplers for v in s.sample()]
                live.update(render(views, args.interval), refresh=True)
                if _quit_pressed(fd, args.interval - (time.monotonic() - started)):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for sampler in samplers:
            sampler.close()
