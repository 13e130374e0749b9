"""Issue 18: overlap scheduling (`--async-scheduling`, on by default) changes no output of the
real model.

Eight requests at once (so they share steps: prefill chunks beside decodes), 32 tokens each,
greedy, fp32 on both engines: chat requests that end on the model's EOS, a stop token id and a
stop string that fire mid-generation (taken from a first run, so they are known to occur),
plain length-limited prompts. The session engine (overlap on, the default) and the session's
reference engine (conftest.py: `--no-async-scheduling`, one plan in flight; also no prefix
caching, which changes no output either: test_prefix_caching.py) must give identical token ids,
text and finish reasons; the session engine's step log must show at least one plan sent before
the previous step's result (real overlap). How many steps overlap depends on timing (with long
steps, just-in-time plans hold plan N+1 until shortly before step N is expected to end), so the
count is not asserted. Both engines are shared with other tests: this test itself costs
three runs of 8 x 32 tokens (~5-15 s on the shared 2-core machine).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.steplog import read_step_log
from shared.client import Client, Completion
from tests.e2e.conftest import Engine

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "List three colors:",
]
CHATS = [
    [{"role": "user", "content": "Say hello in one word."}],
    [{"role": "user", "content": "What is 2 + 2? Answer with a number."}],
    [{"role": "user", "content": "Name one planet."}],
]


def _num_overlapped(log: Path, t_start: float, t_end: float) -> int:
    """Steps between `t_start` and `t_end` whose plan left before the previous step's result
    arrived (the session engine's log also holds other tests' steps)."""
    steps = [s for s in read_step_log(log) if t_start <= s.t_plan and s.t_result <= t_end]
    return sum(b.t_plan < a.t_result for a, b in zip(steps, steps[1:], strict=False))


def _dtype(engine: Engine) -> str:
    ready = [r for r in engine.log_records("scheduler") if r.get("event") == "worker_ready"]
    return str(ready[-1]["dtype"])


def _run_all(address: str, requests: list[dict[str, Any]]) -> list[Completion]:
    def one(kw: dict[str, Any]) -> Completion:
        with Client(address, timeout=300.0) as client:
            return client.generate(max_tokens=MAX_TOKENS, temperature=0.0, **kw)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def _requests(first: list[Completion]) -> tuple[list[dict[str, Any]], list[int]]:
    """The eight requests: the two plain prompts with the longest first-run outputs get a stop
    token id and a stop string from the middle of those outputs (so they fire), the rest are
    as they are. Also returns the indices of those two."""
    requests: list[dict[str, Any]] = [{"prompt": p} for p in PROMPTS]
    requests += [{"messages": m} for m in CHATS]
    by_len = sorted(range(len(PROMPTS)), key=lambda i: -len(first[i].token_ids))
    a, b = by_len[:2]
    assert len(first[b].token_ids) >= 6, [c.text for c in first]
    tokens = first[a].token_ids
    requests[a] = {**requests[a], "stop_token_ids": [tokens[len(tokens) // 2]]}
    text = first[b].text
    middle = len(text) // 2
    requests[b] = {**requests[b], "stop": [text[middle : middle + 3]]}
    return requests, [a, b]


def test_async_scheduling_changes_no_output(engine: Engine, reference_engine: Engine) -> None:
    # token equality needs the same dtype on both, named (not `auto`): fp32
    assert _dtype(engine) == _dtype(reference_engine) == "float32"
    first = _run_all(reference_engine.frontend_address, [{"prompt": p} for p in PROMPTS])
    requests, (a, b) = _requests(first)
    want = _run_all(reference_engine.frontend_address, requests)
    t_start = time.time()
    got = _run_all(engine.frontend_address, requests)
    t_end = time.time()
    for kw, w, g in zip(requests, want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), kw
    reasons = [w.finish_reason for w in want]
    assert reasons.count("stop") >= 3, reasons  # the stop id, the stop string, EOS
    assert len(want[a].token_ids) < len(first[a].token_ids)  # the stop token fired
    assert len(want[b].text) < len(first[b].text)  # the stop string fired
    # the session engine really overlapped (async scheduling is its default): at least once
    assert _num_overlapped(engine.log_dir / "scheduler.log", t_start, t_end) > 0
