"""The whole-layer C++ kernel (kernels/csrc/decoder_layer.cpp) against the model's Python layer.

On the tiny random model with packed block weights (`--quantization q4_1`) and the C++ ops:
the model takes the whole-layer path, and a mixed step (a prompt chunk beside a decode) then a
decode give bit-equal logits and KV cache contents either way (the same kernels in the same
order). Dense weights or an 8-bit KV cache keep the Python layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from tests.support.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def runner_for(tiny: Path, **config: str) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20, **config)
    )


def two_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a mixed step (a 9-token prompt beside the decode of a sequence with 20 cached
    tokens) and of the decode step after it, then the K pool of every layer."""
    writer = PlanWriter()
    old = writer.new_sequence("old", list(range(3, 24)), 21, [0, 1], GREEDY, num_computed_tokens=20)
    new = writer.new_sequence("new", list(range(40, 49)), 9, [2], GREEDY)
    out = []
    for plan in (writer.plan({"old": 1, "new": 9}, [old, new]), writer.plan({"old": 1, "new": 1})):
        logits = runner.compute_logits(plan)
        assert logits is not None
        out.append(logits)
        runner.record_tokens(logits.argmax(-1).tolist())
    out.append(torch.stack([k for k, _ in runner.kv_cache.layers]))
    return out


def test_the_whole_layer_kernel_equals_the_python_layer(tiny: Path) -> None:
    native, python = runner_for(tiny, quantization="q4_1"), runner_for(tiny, quantization="q4_1")
    assert native.model.native and native.model.ops.name == "cpu"
    python.model.use_native_layers(False)
    got, want = two_steps(native), two_steps(python)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), float((a - b).abs().max())
    assert got[-1].abs().sum() > 0  # the kernel wrote K


def test_dense_weights_or_an_8bit_kv_cache_keep_the_python_layer(tiny: Path) -> None:
    assert not runner_for(tiny, quantization="none").model.native
    runner = runner_for(tiny, quantization="q4_1", kv_cache_dtype="int8")
    assert runner.model.native  # chosen per step: the int8 cache's write is the ops' own
    want = runner_for(tiny, quantization="q4_1", kv_cache_dtype="int8")
    want.model.use_native_layers(False)
    for a, b in zip(two_steps(runner), two_steps(want), strict=True):
        assert torch.equal(a, b)
