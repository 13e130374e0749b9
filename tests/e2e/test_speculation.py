"""Issue 30: speculative decoding (`--speculative ngram`) changes no output of the real model.

An engine of its own with n-gram speculation (fp32, async scheduling and prefix caching on, as
the session engine) and the session engine without it get the same requests at once, so drafted
decodes share steps with prefill chunks and plain decodes: prompts the model copies from (text
and code to repeat, so n-grams match), a chat, plain prompts; streamed and not; greedy, and one
seeded sampled request; two of them ask for logprobs (their drafts are accepted too). Token ids,
text and finish reasons must be identical, the speculating engine must have proposed drafts,
accepted some and rejected some (a run where speculation never engaged proves nothing), and the
logprobs must agree: one per token, the same top tokens, each logprob within LOGPROB_TOL. Why a
tolerance: an accepted draft's logprobs come from its own row of a forward over 1 + d query
tokens of that sequence (and another batch), a plain decode's from a forward of 1: the same fp32
sums in another order, so the logits differ by rounding (~1e-6 relative per operation over 30
layers; tensor parallelism, the same sums split across ranks, agrees within 1e-4, as here).
~1-2 minutes on the shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from shared.client import Client, Completion
from tests.e2e.conftest import REFERENCE_KV_CACHE_MEMORY, Engine
from tests.e2e.stack_tools import ENGINE_WORKER, engine_settings, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 40
LOGPROB_TOL = 1e-4  # see the module docstring
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
REQUESTS: list[dict[str, Any]] = [
    {"prompt": f"Repeat the sentence twice.\n{TEXT}\n{TEXT}\n"},
    {"prompt": f"{CODE}\n\n{CODE}", "stream": True},
    {"prompt": f"Copy this code exactly:\n{CODE}\nCopy:\n"},
    {"messages": [{"role": "user", "content": f"Repeat exactly: {TEXT}"}], "stream": True},
    {"prompt": "The capital of France is"},
    {"prompt": f"{TEXT} {TEXT}", "temperature": 0.7, "seed": 7},
    {"prompt": f"Repeat the sentence twice.\n{TEXT}\n{TEXT}\n", "logprobs": 3},
    {"prompt": f"{CODE}\n\n{CODE}", "stream": True, "logprobs": 2},
]


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    worker = dataclasses.replace(
        ENGINE_WORKER, kv_cache_memory=REFERENCE_KV_CACHE_MEMORY, speculative="ngram"
    )
    settings = engine_settings(
        tmp_path_factory.mktemp("spec-engine-logs"), gateway=False, worker_config=worker
    )
    for stack in running_stack(settings):
        yield Engine(stack.frontend_address, None, stack.log_dir, stack)


def _run_all(address: str, requests: list[dict[str, Any]] = REQUESTS) -> list[Completion]:
    def one(kw: dict[str, Any]) -> Completion:
        with Client(address, timeout=300.0) as client:
            return client.generate(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **kw})

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def _engine_stats(address: str) -> dict[str, Any]:
    with Client(address, timeout=60.0) as client:
        return dict(client.stats()["engine"])


@dataclasses.dataclass(frozen=True)
class SideBySide:
    """The same requests on a reference engine and a speculating one, with the drafts the
    speculating engine's counters moved by meanwhile."""

    want: list[Completion]
    got: list[Completion]
    num_proposed: int
    num_accepted: int


def side_by_side(
    reference: Engine, speculating: Engine, requests: list[dict[str, Any]] = REQUESTS
) -> SideBySide:
    """Runs `requests` on the reference, then on the speculating engine (alone there)."""
    want = _run_all(reference.frontend_address, requests)
    before = _engine_stats(speculating.frontend_address)
    got = _run_all(speculating.frontend_address, requests)
    after = _engine_stats(speculating.frontend_address)
    proposed, accepted = ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    return SideBySide(
        want, got, after[proposed] - before[proposed], after[accepted] - before[accepted]
    )


def test_ngram_speculation_changes_no_output(engine: Engine, spec_engine: Engine) -> None:
    run = side_by_side(engine, spec_engine)
    for kw, w, g in zip(REQUESTS, run.want, run.got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), kw
        if "logprobs" in kw:
            _check_logprobs(g, w, kw)
    # drafts proposed, accepted, rejected
    assert run.num_proposed > run.num_accepted > 0, (run.num_proposed, run.num_accepted)


def test_requests_asking_for_logprobs_draft_too(engine: Engine, spec_engine: Engine) -> None:
    """Alone on the speculating engine, the requests asking for logprobs get drafts accepted
    (the speculating engine's counters move), and the same tokens and logprobs as without."""
    asking = [kw for kw in REQUESTS if "logprobs" in kw]
    run = side_by_side(engine, spec_engine, asking)
    assert run.num_accepted > 0
    for kw, w, g in zip(asking, run.want, run.got, strict=True):
        assert (g.token_ids, g.text) == (w.token_ids, w.text), kw
        _check_logprobs(g, w, kw)


SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["text", "count"],
    "additionalProperties": False,
}
JSON_REQUESTS: list[dict[str, Any]] = [  # the model copies JSON that the prompt holds
    {
        "prompt": f'Copy this JSON exactly:\n{{"text": "{TEXT}", "count": 2}}\nCopy:\n',
        "json_schema": SCHEMA,
        "max_tokens": 48,
    },  # fmt: skip
    {"prompt": "The capital of France is", "max_tokens": 8},  # a plain neighbour
]


def test_a_json_schema_request_drafts_and_keeps_its_text(
    engine: Engine, spec_engine: Engine
) -> None:
    """Structured outputs under speculation: the grammar masks every verified row (the
    matcher advanced through the drafts), so the text equals the text without, parses,
    and drafts were accepted; the step log's lines carry the drafts."""
    run = side_by_side(engine, spec_engine, JSON_REQUESTS)
    for kw, w, g in zip(JSON_REQUESTS, run.want, run.got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), kw
    assert run.got[0].finish_reason == "stop", run.got[0].text
    assert set(json.loads(run.got[0].text)) == {"text", "count"}
    # the neighbour accepts at most 7 of its 8 tokens
    assert run.num_accepted >= 10, run.num_accepted
    # the step log says the same per step (lines flushed so far: at most the counters)
    steps = [r for r in spec_engine.log_records("scheduler") if r.get("event") == "step"]
    logged = sum(r.get("num_accepted_tokens", 0) for r in steps)
    counted = _engine_stats(spec_engine.frontend_address)["spec_decode_num_accepted_tokens"]
    assert 0 < logged <= counted, (logged, counted)
    assert sum(r.get("num_draft_tokens", 0) for r in steps) >= logged


def _check_logprobs(got: Completion, want: Completion, kw: dict[str, Any]) -> None:
    """One entry per token, the same top tokens, every logprob within LOGPROB_TOL."""
    assert got.logprobs is not None and want.logprobs is not None, kw
    assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids), kw
    for i, (g, w) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert g["top_token_ids"][0] == w["top_token_ids"][0], (kw, i)
        assert abs(g["logprob"] - w["logprob"]) < LOGPROB_TOL, (kw, i, g, w)
        for a, b in zip(g["top_logprobs"], w["top_logprobs"], strict=True):
            assert abs(a - b) < LOGPROB_TOL, (kw, i, g, w)
