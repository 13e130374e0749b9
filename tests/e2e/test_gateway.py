"""The HTTP gateway, driven by the official `openai` package, against a real engine.

1. completions and chat, streaming and not, give the ZeroMQ client's greedy text;
2. bad parameters give an OpenAI-shaped 400, and the next request still succeeds;
3. closing a stream mid-way aborts the request and frees its KV blocks;
4. /metrics parses as Prometheus text and its counters move with requests.

Uses the session `engine` fixture (tests/e2e/conftest.py); when that stack runs no gateway,
this module starts one pointed at the engine's frontend. Rough runtime: ~10 greedy requests of
a few tokens each: 20 s on an idle 2-core machine, minutes when it is busy.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.client import Client, Completion

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]
NUM_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with code {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise TimeoutError(f"gateway at {url} not healthy after {timeout:.0f} s")


@pytest.fixture(scope="module")
def gateway_url(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The engine stack's gateway, or one started here against its frontend."""
    url = getattr(engine, "http_url", None)
    if url:
        yield url
        return
    port = _free_port()
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "services.gateway", "--engine-addr", engine.frontend_address,
            "--http-port", str(port), "--stats-interval", "0.5"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, timeout=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def oai(gateway_url: str) -> openai.OpenAI:
    # max_retries=0: a 429/503 must show up as an error here, not be retried away.
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def model_name(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def zmq_client(engine: Any) -> Iterator[Client]:
    with Client(engine.frontend_address, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def want_completion(zmq_client: Client) -> Completion:
    """The ZeroMQ client's greedy answer to PROMPT: what the gateway must reproduce."""
    want = zmq_client.generate(PROMPT, max_tokens=NUM_TOKENS, temperature=0.0)
    assert want.text
    return want


# ---- 1. same greedy text as the ZeroMQ client ------------------------------------------------


def test_completions_match_the_zmq_client(oai: openai.OpenAI, model_name: str,
                                          want_completion: Completion) -> None:  # fmt: skip
    want = want_completion
    got = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                 temperature=0)  # fmt: skip
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage is not None
    assert got.usage.prompt_tokens == want.usage["prompt_tokens"]
    assert got.usage.completion_tokens == want.usage["completion_tokens"]
    stream = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                    temperature=0, stream=True)  # fmt: skip
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 1 and "".join(pieces) == want.text


def test_chat_matches_the_zmq_client(oai: openai.OpenAI, model_name: str,
                                     zmq_client: Client) -> None:  # fmt: skip
    want = zmq_client.generate(messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0.0)
    assert want.text
    got = oai.chat.completions.create(model=model_name, messages=MESSAGES,  # type: ignore[arg-type]
                                      max_tokens=NUM_TOKENS, temperature=0)  # fmt: skip
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    stream = oai.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=NUM_TOKENS,  # type: ignore[arg-type]
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == want.usage["completion_tokens"]
    # the same prompt ran before (prefix caching is on by default): whole blocks were reused,
    # reported as OpenAI does, in the non-streamed usage and in the include_usage chunk
    for usage in (got.usage, chunks[-1].usage):
        assert usage.prompt_tokens_details is not None
        assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_n_choices_use_derived_seeds(oai: openai.OpenAI, model_name: str,
                                     zmq_client: Client) -> None:  # fmt: skip
    """n=2 with seed s: choice j is what the ZeroMQ client samples with seed s + j."""
    seed, num = 1234, 4
    want = [zmq_client.generate(PROMPT, max_tokens=num, temperature=1.0, seed=seed + j).text
            for j in range(2)]  # fmt: skip
    got = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=num, n=2,
                                 temperature=1.0, seed=seed, logprobs=2)  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == want
    for choice in got.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
        assert len(lp.tokens) == num and all(len(top) == 2 for top in lp.top_logprobs)
    assert got.usage is not None and got.usage.completion_tokens == 2 * num
    stream = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=num, n=2,
                                    temperature=1.0, seed=seed, stream=True)  # fmt: skip
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


# ---- 2. bad parameters: 400, then business as usual ------------------------------------------

BAD_PARAMETERS: list[dict[str, Any]] = [
    {"temperature": -1},
    {"max_tokens": 0},
    {"top_p": 1.5},
    {"n": 1000},
    {"extra_body": {"min_p": 2}},
    {"max_tokens": 10_000_000},  # refused by the engine itself: prompt_too_long
]


def test_bad_parameters_are_400_then_the_next_request_works(
    oai: openai.OpenAI, model_name: str, want_completion: Completion
) -> None:
    for bad in BAD_PARAMETERS:
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=model_name, prompt=PROMPT, **bad)
        assert info.value.status_code == 400
        body = info.value.body
        assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}
        assert body["message"] and body["type"] == "invalid_request_error", body
    after = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                   temperature=0)  # fmt: skip
    assert after.choices[0].text == want_completion.text


# ---- 3. a closed stream frees its KV blocks --------------------------------------------------


def _engine_stats(client: Client) -> dict[str, float]:
    engine = client.stats().get("engine")
    return engine if isinstance(engine, dict) else {}


def _wait_idle(client: Client, timeout: float) -> bool:
    """True once nothing runs and no KV block is in use (within `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _engine_stats(client)
        if stats.get("num_running") == 0 and stats.get("kv_blocks_used") == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def test_closing_a_stream_frees_its_kv_blocks(oai: openai.OpenAI, model_name: str,
                                              zmq_client: Client) -> None:  # fmt: skip
    assert _wait_idle(zmq_client, timeout=30.0), "the engine was busy before the test"
    stream = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    busy = _engine_stats(zmq_client)
    assert busy["num_running"] == 1 and busy["kv_blocks_used"] > 0
    stream.close()
    assert _wait_idle(zmq_client, timeout=10.0), _engine_stats(zmq_client)


# ---- 4. /metrics -----------------------------------------------------------------------------


def _scrape(gateway_url: str) -> dict[str, float]:
    """sample name (with labels) -> value."""
    text = httpx.get(gateway_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_parse_and_counters_move(oai: openai.OpenAI, model_name: str,
                                         gateway_url: str) -> None:  # fmt: skip
    before = _scrape(gateway_url)
    for gauge in ("conveyor:num_requests_running", "conveyor:num_requests_waiting",
                  "conveyor:kv_cache_usage_perc", "conveyor:num_preemptions_total"):  # fmt: skip
        assert gauge + '{engine="0"}' in before, sorted(before)  # per engine (data parallelism)
    out = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0)
    after = _scrape(gateway_url)
    assert out.usage is not None

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("conveyor:prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("conveyor:generation_tokens_total") == out.usage.completion_tokens
    finished = f'conveyor:request_success_total{{finished_reason="{out.choices[0].finish_reason}"}}'
    assert moved(finished) == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "inter_token_latency_seconds"):  # fmt: skip
        assert moved(f"conveyor:{hist}_count") == 1, hist
    assert after["conveyor:e2e_request_latency_seconds_sum"] > before.get(
        "conveyor:e2e_request_latency_seconds_sum", 0.0
    )
