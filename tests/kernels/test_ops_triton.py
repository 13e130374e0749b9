"""The worker's forward with TritonOps (kernels under the interpreter) equals it with TorchOps.

Two ModelRunners on the same tiny random Llama, one per attention backend, are fed the same
plans: fresh prompts, a prefill chunk on top of cached context beside decodes, and a new
sequence joining a running batch. Their logits must agree, and so must greedy generations.
Runtime ~30 s of CPU (the interpreter runs every program one after another).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.worker.config import WorkerConfig
from services.worker.ops_triton import TritonOps
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan
from tests.support.plan_driver import PlanDriver
from tests.support.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
# fp32: reassociation only (measured ~3e-6). bf16: both paths round activations to bf16 at
# every op, the interpreter by truncation (measured ~0.1); logits of this model are O(1), and a
# wrong mask or rotation moves them by ~2.
LOGIT_ATOL = {"float32": 1e-4, "bfloat16": 0.25}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32 and a 3:1 GQA group exercise the kernels' padding rows.
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny"), num_attention_heads=6, num_key_value_heads=2,
        hidden_size=192, head_dim=32,
    )  # fmt: skip


def make_runner(folder: Path, backend: str, dtype: str) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(folder), dtype=dtype, kv_cache_memory=4 << 20, block_size=16,
            attention_backend=backend,
        )
    )  # fmt: skip


def plans(rng: random.Random) -> list[StepPlan]:
    # histories hold the decode tokens to come (compute_logits samples nothing)
    a = [rng.randrange(3, 265) for _ in range(23)] + [5, 6]
    b = [rng.randrange(3, 265) for _ in range(30)] + [8]
    c = [rng.randrange(3, 265) for _ in range(9)] + [10]
    w = PlanWriter()
    new_ab = [w.new_sequence("a", a, 23, [7, 2], GREEDY), w.new_sequence("b", b, 30, [4], GREEDY)]
    return [
        # a whole prompt, and the first chunk of another
        w.plan({"a": 23, "b": 12}, new_ab),
        # a decodes; b's second chunk sits on 12 cached tokens and crosses a block; c joins
        w.plan({"a": 1, "b": 18, "c": 9}, [w.new_sequence("c", c, 9, [11], GREEDY)], {"b": [9]}),
        # all decode
        w.plan({"a": 1, "b": 1, "c": 1}),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_forward_equals_torch_forward(tiny: Path, dtype: str) -> None:
    torch_runner = make_runner(tiny, "torch", dtype)
    triton_runner = make_runner(tiny, "triton", dtype)
    assert isinstance(triton_runner.model.ops, TritonOps)
    for plan in plans(random.Random(0)):
        expected = torch_runner.compute_logits(plan)
        got = triton_runner.compute_logits(plan)
        assert got.shape == expected.shape and got.isfinite().all()
        diff = float((got - expected).abs().max())
        assert diff < LOGIT_ATOL[dtype], f"step {plan.step_id}: max |logit diff| {diff:.3g}"
        assert expected.std() > 0.1  # a real signal, not a degenerate model


def test_greedy_generation_identical(tiny: Path) -> None:
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(3, 265) for _ in range(n)] for i, n in enumerate((5, 21))}
    outputs = []
    for backend in ("torch", "triton"):
        runner = make_runner(tiny, backend, "float32")
        driver = PlanDriver(runner.execute, runner.kv_cache.num_blocks, 16, chunk_size=16,
                            shuffle_seed=2)  # fmt: skip
        for rid, ids in prompts.items():
            driver.add(rid, ids, GREEDY)
        outputs.append(driver.run())
    assert outputs[0] == outputs[1]
    assert all(len(v) == GREEDY.max_tokens for v in outputs[0].values())
