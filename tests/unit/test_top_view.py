"""`conveyor top`'s screen (conveyor/top.py `render`): one column per engine, the numbers of
its stats reply, and why an engine that did not answer is blank."""

from __future__ import annotations

import re

from rich.console import Console

from conveyor.top import EngineView, render


def _text(views: list[EngineView]) -> str:
    console = Console(record=True, width=120, color_system=None)
    console.print(render(views, interval=1.0))
    return console.export_text()


def test_one_column_per_engine_with_its_numbers() -> None:
    busy = EngineView(
        "tcp://a:1", ready=True,
        engine={"num_running": 5, "num_waiting": 2, "kv_usage": 0.125},
        frontend={"num_finished_1m": 7, "ttft_p50_s": 0.05, "ttft_p90_s": 0.2,
                  "ttft_p99_s": 0.9, "tpot_p50_s": 0.012},
        prompt_tokens_per_s=1234.4, generation_tokens_per_s=88.6,
    )  # fmt: skip
    down = EngineView("tcp://b:2", error="engine_unreachable: cannot connect")
    text = _text([busy, down])
    assert "tcp://a:1" in text and "tcp://b:2" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    assert rows["running"] == ["5"] and rows["waiting"] == ["2"]
    assert re.search(r"KV use\s+12\.5%", text)
    assert re.search(r"prompt tok/s\s+1234", text) and re.search(r"gen tok/s\s+89", text)
    assert re.search(r"TTFT ms p50/90/99\s+50/200/900", text)
    assert re.search(r"TPOT ms p50/90/99\s+12/-/-", text)
    assert "unreachable" in text and "tcp://b:2: engine_unreachable: cannot connect" in text


def test_an_engine_not_ready_says_so() -> None:
    text = _text([EngineView("tcp://c:3", ready=False, engine=None)])
    assert re.search(r"state\s+not ready", text)


def test_each_engine_shows_its_role_and_kv_hand_over() -> None:
    prefill = EngineView("tcp://a:1 #0", ready=True, role="prefill",
                         engine={"num_leases": 3, "kv_usage": 0.5})  # fmt: skip
    decode = EngineView("tcp://a:1 #1", ready=True, role="decode",
                        engine={"num_leases": 0, "kv_pull_bytes": 12.5e6})  # fmt: skip
    text = _text([prefill, decode])
    assert re.search(r"role\s+prefill\s+decode", text)
    assert re.search(r"KV leases\s+3\s+0", text) and re.search(r"KV pulled MB\s+-\s+12\.5", text)
