"""Each step composition on the real model: greedy text equals transformers' fp32 greedy text.

`mixed` is the session engine's (test_engine_reference.py); here one engine per other
composition, both started at once (one model load's time), with a small token budget and chunk
so the four prompts, sent together while a long request decodes, are prefilled in chunks beside
other requests' decodes: a prompt forward between decode forwards (decode-first, at most `max_prefill_chunks` chunks), or
prefill-only forwards holding the decodes back (prefill-first). The engines' step logs must
show that shape. Exact, except at a near-tie of the reference's own logits
(tests/greedy_reference.py). Rough runtime: 30-60 s on the shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.steplog import StepEntry, read_step_log
from conveyor.launcher import LocalStack
from services.scheduler.config import SchedulerConfig
from shared.client import Client, Completion
from tests.e2e.conftest import READY_TIMEOUT_S, REFERENCE_KV_CACHE_MEMORY
from tests.e2e.stack_tools import ENGINE_WORKER, engine_settings
from tests.e2e.test_engine_reference import MAX_TOKENS, PROMPTS
from tests.greedy_reference import compare_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.model]

COMPOSITIONS = ("prefill-first", "decode-first")
# small enough that the prompts (9-14 tokens) take two chunks and share steps with decodes
CONFIG = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=16, chunk_size=8)
# decoding while PROMPTS arrive: long enough to outlast their prefill on any host
BACKGROUND_PROMPT = "Write a long story about a lighthouse keeper."
BACKGROUND_TOKENS = 128


@pytest.fixture(scope="module")
def composition_engines(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, LocalStack]]:
    stacks = {}
    try:
        for name in COMPOSITIONS:
            settings = engine_settings(
                tmp_path_factory.mktemp(f"{name}-logs"),
                gateway=False,
                scheduler_config=dataclasses.replace(CONFIG, step_composition=name),
                worker_config=dataclasses.replace(
                    ENGINE_WORKER, kv_cache_memory=REFERENCE_KV_CACHE_MEMORY
                ),
            )
            stacks[name] = LocalStack(settings).start()
        for stack in stacks.values():
            stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture(scope="module")
def hf_greedy(hf_reference) -> dict[str, tuple[list[int], str, list[Any]]]:
    """transformers' greedy continuation of each prompt, once for both compositions."""
    return {prompt: hf_reference.greedy(prompt, MAX_TOKENS) for prompt in PROMPTS}


def _beside_a_decoding_request(address: str) -> list[Completion]:
    """PROMPTS' completions, sent once a long background request is decoding (its first chunk
    came back), so their prompt forwards meet decodes however fast the host is."""
    with Client(address, timeout=300.0) as client:
        background = iter(
            client.stream(BACKGROUND_PROMPT, max_tokens=BACKGROUND_TOKENS, temperature=0.0,
                          ignore_eos=True)
        )  # fmt: skip
        next(background)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: _generate(address, p), PROMPTS))
        for _ in background:  # its text is not compared: it only keeps decoding
            pass
    return results


def _generate(address: str, prompt: str) -> Completion:
    with Client(address, timeout=300.0) as client:
        return client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_each_composition_gives_transformers_greedy_text(
    composition: str, composition_engines: dict[str, LocalStack], hf_greedy
) -> None:
    stack = composition_engines[composition]
    results = _beside_a_decoding_request(stack.frontend_address)
    for prompt, got in zip(PROMPTS, results, strict=True):
        want_ids, want_text, want_logits = hf_greedy[prompt]
        if compare_greedy(got.token_ids, want_ids, want_logits, f"{composition}: {prompt}") is None:
            assert got.text == want_text, prompt
    steps = read_step_log(Path(stack.log_dir) / "scheduler.log")
    prompt_steps = [i for i, s in enumerate(steps) if any(s.is_prefill)]
    assert all(all(steps[i].is_prefill) for i in prompt_steps), "a prompt chunk beside decodes"
    # beside other requests: a prompt forward while another request was decoding
    assert any(_decoding_around(steps, i) for i in prompt_steps)
    if composition == "decode-first":
        assert all(len(steps[i].rids) <= CONFIG.max_prefill_chunks for i in prompt_steps)


def _decoding_around(steps: list[StepEntry], i: int) -> bool:
    """Some other request decoded both before and after prompt step `i`."""
    before = {r for s in steps[:i] if s.is_decode_only for r in s.rids}
    after = {r for s in steps[i + 1 :] if s.is_decode_only for r in s.rids}
    return bool((before & after) - set(steps[i].rids))
