"""Disaggregated prefill and decode engines with tensor parallelism on both sides (issue 32;
docs/design/disaggregation.md, "Tensor parallelism"), real processes: a tiny random Llama
(4 heads, 2 KV heads) at `--tensor-parallel-size 2`, one prefill and one decode engine (four
worker ranks over gloo): each decode rank pulls its own KV-head shard from the prefill rank of
the same number. Greedy output, non-streamed one by one and streamed all at once, equals the
model at TP=1 (transformers fp32, tests/greedy_reference.py: exact but at a near-tie of the
reference), and every prompt's KV was pulled (the decode engine's counters), none recomputed.
Rough runtime: 15-30 s on the shared 2-core machine (four tiny ranks, two schedulers).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.launcher import LocalStack
from shared.client import Client
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import engine_settings, running_stack
from tests.greedy_reference import compare_greedy, hf_greedy_with_logits
from tests.support.greedy_streams import (
    HANDOVER_WORKER,
    handover_prompts,
    stream_greedy,
    write_two_kv_head_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WAIT_S = 120.0 + SLOW_HOST_MARGIN_S
MAX_TOKENS = 12
PROMPTS = handover_prompts(4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "tiny"
    return write_two_kv_head_model(folder)


@pytest.fixture(scope="module")
def disagg_tp2(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[LocalStack]:
    settings = engine_settings(
        tmp_path_factory.mktemp("disagg-tp-logs"), gateway=False, model=str(model),
        prefill_engines=1, decode_engines=1, tensor_parallel_size=2, worker_config=HANDOVER_WORKER,
    )  # fmt: skip
    yield from running_stack(settings)


def test_tp2_hand_over_moves_each_ranks_shard_and_equals_tp1(
    disagg_tp2: LocalStack, model: Path
) -> None:
    reference = hf_greedy_with_logits(model, PROMPTS, MAX_TOKENS, ignore_eos=True)
    with Client(disagg_tp2.frontend_address, timeout=WAIT_S) as client:
        got = [client.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0,
                               ignore_eos=True).token_ids for ids in PROMPTS]  # fmt: skip
    streamed = stream_greedy(disagg_tp2.frontend_address, PROMPTS, MAX_TOKENS, WAIT_S)
    for n, (want, logits) in enumerate(reference):
        compare_greedy(got[n], want, logits, f"prompt {n}")
        assert streamed[n] == got[n], f"prompt {n}: streamed differs from non-streamed"
    with Client(disagg_tp2.frontend_address, timeout=WAIT_S) as client:
        engines = client.stats()["engines"]
    decode, prefill = engines["1"], engines["0"]
    pulls = {k: v for k, v in decode.items() if "kv_pull" in k}
    # every prompt twice, each with two full blocks: pulled (by both ranks), none recomputed
    assert decode["num_kv_pulls"] == 2 * len(PROMPTS), pulls
    assert decode["num_kv_pull_failures"] == 0, pulls
    assert prefill["num_finished_handover"] == 2 * len(PROMPTS)
