"""Disaggregated prefill and decode engines of different tensor-parallel sizes (issue 32;
docs/design/disaggregation.md, "Tensor parallelism"), real processes: a tiny random Llama
(4 heads, 2 KV heads), one prefill engine at TP=1 and one decode engine at TP=2 (each decode
rank reads its KV head from the prefill worker's one shard), and the other way round (the
decode worker assembles its two heads from both prefill ranks). `conveyor up` gives every
engine one TP size, so the stack here starts each engine with its own (`MixedTpStack`).
Greedy output, streamed all at once, equals the model at TP=1 (transformers fp32,
tests/greedy_reference.py), and every prompt's KV was pulled by every decode rank, none
recomputed. Rough runtime: 10-20 s a layout on the shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.launcher import LocalStack
from conveyor.stack_settings import StackSettings
from shared.client import Client
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import READY_TIMEOUT_S, engine_settings
from tests.greedy_reference import compare_greedy, hf_greedy_with_logits
from tests.support.greedy_streams import (
    HANDOVER_WORKER,
    handover_prompts,
    stream_greedy,
    write_two_kv_head_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WAIT_S = 120.0 + SLOW_HOST_MARGIN_S
MAX_TOKENS = 10
PROMPTS = handover_prompts(3)


class MixedTpStack(LocalStack):
    """A local stack whose engine i runs `tp_sizes[i]` worker ranks."""

    def __init__(self, settings: StackSettings, tp_sizes: tuple[int, ...]) -> None:
        super().__init__(settings)
        self._tp_sizes = tp_sizes

    def _start_engine(self, index: int) -> str:
        shared = self.settings
        self.settings = dataclasses.replace(shared, tensor_parallel_size=self._tp_sizes[index])
        try:
            return super()._start_engine(index)
        finally:
            self.settings = shared


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "tiny"
    return write_two_kv_head_model(folder)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[tuple[list[int], list]]:
    return hf_greedy_with_logits(model, PROMPTS, MAX_TOKENS, ignore_eos=True)


@pytest.fixture(params=[(1, 2), (2, 1)], ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1"])
def mixed_tp(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model: Path
) -> Iterator[LocalStack]:
    settings = engine_settings(
        tmp_path_factory.mktemp("disagg-reshard-logs"), gateway=False, model=str(model),
        prefill_engines=1, decode_engines=1, worker_config=HANDOVER_WORKER,
    )  # fmt: skip
    stack = MixedTpStack(settings, request.param).start()
    try:
        stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield stack
    finally:
        stack.stop()


def test_a_hand_over_between_tp_sizes_is_re_sharded_and_equals_tp1(
    mixed_tp: LocalStack, reference: list[tuple[list[int], list]]
) -> None:
    stack = mixed_tp
    streamed = stream_greedy(stack.frontend_address, PROMPTS, MAX_TOKENS, WAIT_S)
    for n, (want, logits) in enumerate(reference):
        compare_greedy(streamed[n], want, logits, f"prompt {n}")
    with Client(stack.frontend_address, timeout=WAIT_S) as client:
        engines = client.stats()["engines"]
    decode, prefill = engines["1"], engines["0"]
    pulls = {k: v for k, v in decode.items() if "kv_pull" in k}
    assert decode["num_kv_pulls"] == len(PROMPTS), pulls  # every rank's shard, none recomputed
    assert decode["num_kv_pull_failures"] == 0, pulls
    assert prefill["num_finished_handover"] == len(PROMPTS)
