"""The worker's quantized weights behind the model's policy seam (services/worker/linear.py).

On the tiny random model: every block format through the C++ kernel gives the logits the dense
path gives on the same dequantized weights (up to summation order), and so does int8 (weight-only,
one fp16 scale per group of weights along K) on its own rounded weights; the requantized
settings stay close; a compact KV cache holds twice the blocks in the same bytes; `auto` keeps
an unquantized checkpoint dense; the handshake names what the weights and the KV pool are; the
settings refuse what they cannot serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.quant import QuantWeight, quantize
from services.worker.config import (
    WorkerConfig,
    resolve_kv_cache_dtype,
    resolve_quantization,
)
from services.worker.int8_linear import GROUP_SIZE, Int8Weights, groupwise_int8
from services.worker.linear import BlockWeights, DenseWeights
from services.worker.model import LlamaModel
from services.worker.ops import TorchOps
from services.worker.ops_cpu import try_load_cpu_ext
from services.worker.plan_writer import PlanWriter
from services.worker.quantization import make_policy
from services.worker.runner import ModelRunner
from services.worker.weights import load_weights, model_args
from shared.prefix_hash import cache_namespace
from shared.protocol.sampling import SamplingParams
from tests.support.tiny_model import write_tiny_model

LINEAR_SUFFIXES = ("_proj.weight", "embed_tokens.weight")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    w = PlanWriter()
    new = w.new_sequence("a", ids, len(ids), [0, 1, 2], SamplingParams(temperature=0.0))
    return runner.compute_logits(w.plan({"a": len(ids)}, [new]))  # type: ignore[return-value]


def _forward(model: LlamaModel, runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    w = PlanWriter()
    new = w.new_sequence("a", ids, len(ids), [0, 1, 2], SamplingParams(temperature=0.0))
    step = runner.held.apply(w.plan({"a": len(ids)}, [new]))
    return model.forward(runner.inputs.tensors(step, every_row=True), runner.kv_cache.layers)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_block_weights_give_the_dense_logits_of_their_dequantized_weights(
    tiny: Path, fmt: str
) -> None:
    ext = try_load_cpu_ext()
    assert ext is not None
    runner = ModelRunner(WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20))
    args = model_args(tiny)
    dense = dict(load_weights(tiny, torch.float32, "cpu"))
    blocks = {n: quantize(t, fmt) if n.endswith(LINEAR_SUFFIXES) else t for n, t in dense.items()}
    dequantized = {n: t.dequantize() if isinstance(t, QuantWeight) else t
                   for n, t in blocks.items()}  # fmt: skip
    ops = TorchOps()
    quant_model = LlamaModel(args, blocks, ops, 64, "cpu", policy=BlockWeights(ext, torch.float32))
    ref_model = LlamaModel(args, dequantized, ops, 64, "cpu", policy=DenseWeights(torch.float32))
    ids = [5, 17, 200, 33, 9, 64, 101]
    got, want = _forward(quant_model, runner, ids), _forward(ref_model, runner, ids)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), float((got - want).abs().max())
    assert quant_model.weight_bytes() < ref_model.weight_bytes()


def test_int8_weights_give_the_dense_logits_of_their_groupwise_rounding(tiny: Path) -> None:
    ext = try_load_cpu_ext()
    assert ext is not None
    runner = ModelRunner(WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20))
    args = model_args(tiny)
    dense = dict(load_weights(tiny, torch.float32, "cpu"))
    rounded = {
        n: groupwise_int8(t).dequantize() if n.endswith("_proj.weight")
        else quantize(t, "q8_0").dequantize() if n.endswith("embed_tokens.weight")
        else t
        for n, t in dense.items()
    }  # fmt: skip
    codes = groupwise_int8(dense["model.layers.0.mlp.down_proj.weight"])
    per_group = codes.d.view(codes.d.shape[0], -1, GROUP_SIZE // 32)
    assert torch.equal(per_group, per_group[..., :1].expand_as(per_group))  # one per group
    assert torch.equal(codes.d.half().float(), codes.d)  # fp16 scales, as the kernel holds them
    assert int(codes.codes.abs().max()) == 127
    whole_rows = groupwise_int8(dense["model.layers.0.mlp.down_proj.weight"], group=1 << 20)
    assert torch.equal(whole_rows.d, whole_rows.d[:, :1].expand_as(whole_rows.d))
    ops = TorchOps()
    int8_model = LlamaModel(args, dense, ops, 64, "cpu", policy=Int8Weights(torch.float32))
    ref_model = LlamaModel(args, rounded, ops, 64, "cpu", policy=DenseWeights(torch.float32))
    ids = [5, 17, 200, 33, 9, 64, 101]
    got, want = _forward(int8_model, runner, ids), _forward(ref_model, runner, ids)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), float((got - want).abs().max())
    assert int8_model.weight_bytes() < ref_model.weight_bytes() / 2


@pytest.mark.parametrize("quantization", ["q4_1", "q8_0", "int8"])
def test_requantized_runners_stay_near_the_dense_one(tiny: Path, quantization: str) -> None:
    base = dict(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20)
    dense = _logits(ModelRunner(WorkerConfig(**base)), [5, 17, 200, 33, 9])
    runner = ModelRunner(WorkerConfig(**base, quantization=quantization))
    got = _logits(runner, [5, 17, 200, 33, 9])
    assert runner.quantization == quantization
    # 4 bits of a random Gaussian weight keep ~90% of it per layer (unrelated logits: ~1.4)
    tolerance = {"q4_1": 0.5, "q8_0": 0.05, "int8": 0.05}[quantization]
    rel = float((got - dense).norm() / dense.norm())
    assert rel < tolerance, rel
    ready = runner.ready_message()
    assert (ready.quantization, ready.kv_cache_dtype) == (quantization, "float32")


def test_a_compact_kv_cache_holds_twice_the_blocks(tiny: Path) -> None:
    base = dict(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20)
    full = ModelRunner(WorkerConfig(**base))
    half = ModelRunner(WorkerConfig(**base, kv_cache_dtype="bfloat16"))
    assert half.kv_cache.num_blocks == 2 * full.kv_cache.num_blocks
    assert half.ready_message().kv_cache_dtype == "bfloat16"
    a, b = _logits(full, [5, 17, 200, 33, 9]), _logits(half, [5, 17, 200, 33, 9])
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())


def test_auto_keeps_an_unquantized_checkpoint_dense(tiny: Path) -> None:
    runner = ModelRunner(WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=4 << 20))
    assert runner.quantization == "none" and runner.ready_message().quantization == "none"


def test_settings_resolve_and_refuse() -> None:
    assert resolve_quantization(WorkerConfig(), has_gguf_blocks=True) == "gguf"
    assert resolve_quantization(WorkerConfig(), has_gguf_blocks=False) == "none"
    assert resolve_quantization(WorkerConfig(device="cuda"), has_gguf_blocks=True) == "none"
    assert resolve_quantization(WorkerConfig(quantization="q8_0"), False) == "q8_0"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization(WorkerConfig(device="cuda", quantization="q4_1"), True)
    assert resolve_kv_cache_dtype(WorkerConfig(), "float32") == "float32"
    assert resolve_kv_cache_dtype(WorkerConfig(kv_cache_dtype="float16"), "float32") == "float16"
    with pytest.raises(ValueError, match="quantization must be one of"):
        WorkerConfig(quantization="q5_k")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        WorkerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="C\\+\\+ CPU extension"):
        make_policy("q4_1", torch.float32, None)


def test_the_prefix_cache_namespace_tells_number_formats_apart() -> None:
    keys = {
        cache_namespace("m", "float32", extra=f"quantization={q};kv={kv}")
        for q in ("none", "gguf", "int8")
        for kv in ("float32", "bfloat16")
    }
    assert len(keys) == 6


def test_the_dtype_probe_retakes_busy_figures_and_measures_near_ties_longer(
    tiny: Path, tmp_path: Path
) -> None:
    from services.worker.dtype_probe import (
        MAX_ROUNDS,
        QUIET_LOAD,
        ROUNDS,
        decide_cpu_dtype,
        near_threshold,
        probe_key,
    )
    from services.worker.dtype_probe import linear_shapes as shapes_of

    args = model_args(tiny)
    busy = decide_cpu_dtype(args, tmp_path, load_fn=lambda: QUIET_LOAD + 1.0)
    assert busy.source == "probe" and ROUNDS <= busy.rounds <= MAX_ROUNDS and busy.probed_at
    record = json.loads((tmp_path / f"{probe_key(shapes_of(args))}.json").read_text())
    assert record["quiet"] is False and len(record["samples"]["float32"]) == busy.rounds
    # still busy: the busy figures stand; quiet now: measured again, and kept from then on
    assert decide_cpu_dtype(args, tmp_path, load_fn=lambda: QUIET_LOAD + 1.0).source == "cache"
    assert decide_cpu_dtype(args, tmp_path, load_fn=lambda: 0.0).source == "probe"
    assert decide_cpu_dtype(args, tmp_path, load_fn=lambda: 0.0).source == "cache"
    assert near_threshold({"float32": 10.0, "bfloat16": 15.5})
    assert not near_threshold({"float32": 10.0, "bfloat16": 17.0})


def test_the_simulated_worker_prices_quantized_weights_by_their_bytes() -> None:
    from services.worker.sim.config import SimConfig
    from services.worker.sim.runner import SimRunner

    step = {}
    for dtype in ("bfloat16", "q8_0", "q4_1"):
        runner = SimRunner(SimConfig(device="h200", model="llama-3-8b", weight_dtype=dtype))
        step[dtype] = runner.model.step_weight_bytes
        assert runner.ready_message().dtype == dtype
    assert step["q4_1"] == pytest.approx(step["bfloat16"] * 0.625 / 2, rel=1e-6)
    assert step["q4_1"] < step["q8_0"] < step["bfloat16"]
