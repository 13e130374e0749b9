"""The simulated worker's cost model against hand-computed figures."""

from __future__ import annotations

import json

import pytest

from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.profiles import (
    DEVICES,
    MODELS,
    DeviceProfile,
    ModelShape,
    device_from_dict,
    load_device,
)

# L=2, h=4, I=8, H=2, Hkv=1, D=2, V=10, tied. Per layer: q,o 2*(4*2*2)=32, k,v 2*(4*1*2)=16,
# MLP 3*4*8=96 -> 144 linear params; LM head 10*4=40; K+V per token 2*2*1*2 elems * 2 B = 16 B;
# weights read per step (2*144 + 40) * 2 B = 656 B.
TINY = ModelShape("tiny", 2, 4, 8, 2, 1, 2, 10, True, 64, [1])
DEV = DeviceProfile(
    "test", dense_flops=1000.0, attention_flops=100.0, bandwidth=1000.0, memory_bytes=10**6,
    launch_s=0.5, per_seq_s=0.1, kv_bandwidth=1000.0,
)  # fmt: skip


def test_tiny_shape_by_hand() -> None:
    assert TINY.linear_params_per_layer == 144
    assert TINY.kv_bytes_per_token == 16
    assert TINY.step_weight_bytes == 656
    # embeddings 40 + 2 layers * (144 + 2 norms * 4) + final norm 4 (head tied)
    assert TINY.num_params == 40 + 2 * 152 + 4


def test_decode_step_by_hand() -> None:
    w = step_work(TINY, [5], [1], num_sampled=1)
    assert w.linear_flops == 2 * 2 * 144 + 2 * 40  # 656
    # one query at position 5 meets 6 keys: 4 * L * H * D * 6
    assert w.attention_flops == 4 * 2 * 2 * 2 * 6  # 192
    assert w.kv_bytes == 16 * (6 + 1)  # read 6 tokens, write 1
    c = step_cost(DEV, w)
    assert c.compute_s == pytest.approx(656 / 1000 + 192 / 100)  # 2.576
    assert c.memory_s == pytest.approx((656 + 112) / 1000)  # 0.768
    assert c.bound == "compute"
    assert c.total_s == pytest.approx(0.5 + 0.1 + 2.576)


def test_mixed_step_memory_bound_by_hand() -> None:
    # a 4-token prefill chunk from 0 (sampled) beside a decode at 5 (sampled)
    w = step_work(TINY, [0, 5], [4, 1], num_sampled=2)
    assert w.linear_flops == 2 * 2 * 144 * 5 + 2 * 40 * 2  # 3040
    assert w.attention_flops == 4 * 2 * 2 * 2 * (4 * 5 / 2 + 6)  # 16 pairs -> 512
    assert w.kv_bytes == 16 * ((4 + 6) + 5)  # 240
    slow_memory = DeviceProfile(
        "m", 1e6, 1e6, 10.0, 10**6, launch_s=0.01, per_seq_s=0.002, kv_bandwidth=10.0
    )
    c = step_cost(slow_memory, w)
    assert c.bound == "memory"
    assert c.total_s == pytest.approx(0.01 + 2 * 0.002 + (656 + 240) / 10.0)


def test_cpu_terms_by_hand() -> None:
    """KV traffic at its own rate; a second pass over the weights when more than one token is
    computed (matrix-matrix kernels); a fixed extra cost when a prompt chunk runs."""
    cpu = DeviceProfile(
        "cpu", None, None, bandwidth=100.0, memory_bytes=10**6, launch_s=0.5,
        kv_bandwidth=10.0, pack_bandwidth=50.0, prefill_step_s=2.0,
    )  # fmt: skip
    one = step_cost(cpu, step_work(TINY, [5], [1], num_sampled=1))
    assert one.total_s == pytest.approx(0.5 + 656 / 100 + 112 / 10)  # one token: no pack pass
    two = step_cost(cpu, step_work(TINY, [5, 5], [1, 1], num_sampled=2))
    assert two.total_s == pytest.approx(0.5 + 656 / 100 + 224 / 10 + 656 / 50)  # no chunk
    chunk = step_cost(cpu, step_work(TINY, [0], [4], num_sampled=1))
    assert chunk.overhead_s == pytest.approx(0.5 + 2.0)
    assert chunk.memory_s == pytest.approx(656 / 100 + 16 * (4 + 4) / 10 + 656 / 50)


def test_prefill_attention_is_causal_and_continues_from_cache() -> None:
    # chunk of 3 after 10 cached tokens: queries meet 11, 12, 13 keys
    w = step_work(TINY, [10], [3], num_sampled=0)
    assert w.attention_flops == 4 * 2 * 2 * 2 * (11 + 12 + 13)
    assert w.linear_flops == 2 * 2 * 144 * 3  # no LM head without sampling


def test_zero_cost_profile_costs_nothing() -> None:
    none = DEVICES["none"]
    assert none.zero_cost
    w = step_work(MODELS["llama-3-8b"], [100] * 64, [1] * 64, num_sampled=64)
    assert step_cost(none, w).total_s == 0.0


def test_published_parameter_counts() -> None:
    # Meta: Llama 3 8B has 8.03 B parameters, 70B 70.6 B; SmolLM2-135M: 134.5 M (FACTS.md)
    assert MODELS["llama-3-8b"].num_params == pytest.approx(8.03e9, rel=2e-3)
    assert MODELS["llama-3-70b"].num_params == pytest.approx(70.6e9, rel=2e-3)
    assert MODELS["llama-3.1-405b"].num_params == pytest.approx(405e9, rel=3e-3)  # Meta: 405 B
    assert MODELS["smollm2-135m"].num_params == pytest.approx(134.5e6, rel=2e-3)
    # Llama 3 8B KV: 32 layers * 2 * 8 heads * 128 * 2 B = 128 KiB per token
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 131072


def test_h200_decode_is_memory_bound_and_nearly_flat_in_batch() -> None:
    m, h200 = MODELS["llama-3-8b"], DEVICES["h200"]
    one = step_cost(h200, step_work(m, [512], [1], 1))
    many = step_cost(h200, step_work(m, [512] * 64, [1] * 64, 64))
    assert one.bound == "memory" and many.bound == "memory"
    # batch 1: 15.01 GB of layer + LM head weights, 513 tokens of KV read and 1 written,
    # over 0.8 * 4.8 TB/s, plus 1.5 ms launch
    assert m.step_weight_bytes == 2 * (32 * 218_103_808 + 525_336_576)
    expected = 1.5e-3 + (m.step_weight_bytes + 514 * 131072) / 3.84e12
    assert one.total_s == pytest.approx(expected, rel=1e-9)
    assert many.total_s < 1.5 * one.total_s  # 64x the tokens for < 1.5x the time


def test_profile_json_round_trip(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text(DEV.to_json())
    assert load_device(path) == DEV
    with pytest.raises(ValueError, match="unknown device profile keys"):
        device_from_dict({**json.loads(DEV.to_json()), "bandwith": 1.0})


@pytest.mark.parametrize(
    "kwargs",
    [{"dense_flops": 0.0}, {"bandwidth": -1.0}, {"memory_bytes": 0}, {"launch_s": -1e-3}],
)
def test_bad_profiles_are_rejected(kwargs) -> None:
    base = dict(name="x", dense_flops=1.0, attention_flops=1.0, bandwidth=1.0, memory_bytes=1)
    with pytest.raises(ValueError):
        DeviceProfile(**{**base, **kwargs})
