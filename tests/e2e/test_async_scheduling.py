"""Issue 18: overlap scheduling (`--async-scheduling`) changes no output of the real model.

Eight requests at once (so they share steps: prefill chunks beside decodes), 32 tokens each,
greedy, fp32: chat requests that end on the model's EOS, a stop token id and a stop string that
fire mid-generation (taken from a first run, so they are known to occur), plain length-limited
prompts. The session engine (one plan in flight) and a second engine with
`--async-scheduling` must give identical token ids, text and finish reasons; the async engine's
step log must show plans sent before the previous step's result (real overlap). The extra
engine's model load dominates the runtime (~20-60 s on the shared 2-core machine).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.steplog import read_step_log
from conveyor.launcher import LocalStack
from shared.client import Client, Completion
from tests.e2e.conftest import READY_TIMEOUT_S
from tests.e2e.stack_tools import engine_settings

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


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(frontend address, scheduler log) of an engine with `--async-scheduling`."""
    settings = engine_settings(
        tmp_path_factory.mktemp("async-engine-logs"),
        gateway=False,
        scheduler_flags={"async_scheduling": "true"},
    )
    stack = LocalStack(settings)
    stack.start()
    try:
        stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield stack.frontend_address, Path(settings.log_dir) / "scheduler.log"
    finally:
        stack.stop()


def _num_overlapped(log: Path) -> int:
    """Steps whose plan left before the previous step's result arrived."""
    steps = read_step_log(log)
    return sum(b.t_plan < a.t_result for a, b in zip(steps, steps[1:], strict=False))


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


def test_async_scheduling_changes_no_output(engine, async_engine: tuple[str, Path]) -> None:
    address, log = async_engine
    first = _run_all(engine.frontend_address, [{"prompt": p} for p in PROMPTS])
    requests, (a, b) = _requests(first)
    want = _run_all(engine.frontend_address, requests)
    got = _run_all(address, requests)
    for kw, w, g in zip(requests, want, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), kw
    reasons = [w.finish_reason for w in want]
    assert reasons.count("stop") >= 3, reasons  # the stop id, the stop string, EOS
    assert len(want[a].token_ids) < len(first[a].token_ids)  # the stop token fired
    assert len(want[b].text) < len(first[b].text)  # the stop string fired
    assert _num_overlapped(log) > MAX_TOKENS // 2  # the async engine really overlapped
