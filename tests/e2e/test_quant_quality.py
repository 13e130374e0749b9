"""The quantized settings' quality on the real SmolLM2, and the default engine serving it.

Teacher-forced next-token agreement and perplexity ratio against fp32 transformers on the
dequantized weights (the session's `hf_reference`), over the first 2,048 tokens of the natural
text of bench/quant_quality.py (4 windows of 512; docs/PERFORMANCE.md has the whole text's
figures). Bounds are the documented goals: the GGUF's own blocks >= 99.5% and <= 1.005 (they
read the same numbers; only summation order differs), int8 (weight-only, fp16 scales per 32
weights) >= 97% and <= 1.02, a bf16 KV cache >= 99%. Then one small stack with every worker
default (Q4_1 blocks served natively) answers a request.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.quant_quality import (
    compare,
    engine_stats,
    reference_stats,
    setting_config,
    text_ids,
    windows,
)
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.client import Client
from shared.model_files import prepare_model
from tests.e2e.conftest import HFReference
from tests.e2e.stack_tools import engine_settings, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]
WINDOW = 512
NUM_TOKENS = 4 * WINDOW
# setting -> (resolved quantization, minimum agreement, maximum perplexity ratio)
GOALS = {
    "auto": ("gguf", 0.995, 1.005),
    "int8": ("int8", 0.97, 1.02),  # documented: 97.67% over the whole text (scales per 32)
    "auto//bfloat16": ("gguf", 0.99, 1.02),
}


@pytest.fixture(scope="module")
def wins() -> list[list[int]]:
    return windows(text_ids(prepare_model(None), NUM_TOKENS), WINDOW)


@pytest.fixture(scope="module")
def reference(hf_reference: HFReference, wins: list[list[int]]):
    return reference_stats(hf_reference.model, wins)


@pytest.mark.parametrize("setting", list(GOALS))
def test_quantized_setting_agrees_with_fp32_transformers(
    setting: str, wins: list[list[int]], reference
) -> None:
    quantization, min_agreement, max_ratio = GOALS[setting]
    runner = ModelRunner(setting_config(setting, WINDOW))
    assert runner.quantization == quantization
    r = compare(reference, engine_stats(runner, wins))
    assert r["agreement"] >= min_agreement, r
    assert r["ppl_ratio"] <= max_ratio, r


def test_default_engine_serves_the_gguf_blocks(tmp_path: Path) -> None:
    settings = engine_settings(
        tmp_path,
        gateway=False,
        scheduler_config=SchedulerConfig(max_num_seqs=4),
        worker_config=WorkerConfig(kv_cache_memory=64 << 20, max_model_len=1024),
    )
    for stack in running_stack(settings):
        with Client(stack.frontend_address, timeout=300.0) as client:
            out = client.generate("The capital of France is", max_tokens=8, temperature=0.0)
        assert out.token_ids and out.finish_reason in ("length", "stop")
        lines = (stack.log_dir / "worker.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        ready = [r for r in records if r.get("event") == "worker_ready"]
        assert ready and ready[0]["quantization"] == "gguf"
        assert ready[0]["dtype"] == "float32" and ready[0]["kv_cache_dtype"] == "float32"
