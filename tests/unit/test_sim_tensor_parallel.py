"""The simulated worker's tensor-parallel cost term (issue 16) against hand-computed figures."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.profiles import DEVICES, NVLINK_EFFICIENCY, DeviceProfile, ModelShape

# L=2, hidden 4, I=8, H=2, Hkv=1, D=2, V=10 (as test_sim_cost_model.py)
TINY = ModelShape("tiny", 2, 4, 8, 2, 1, 2, 10, True, 64, [1])
DEV = DeviceProfile(
    "test", dense_flops=1000.0, attention_flops=100.0, bandwidth=1000.0, memory_bytes=10**6,
    launch_s=0.5, per_seq_s=0.1, kv_bandwidth=1000.0, link_bandwidth=64.0, link_latency_s=0.01,
)  # fmt: skip


def test_one_rank_is_the_device_itself() -> None:
    assert DEV.tensor_parallel(1) is DEV
    w = step_work(TINY, [5], [1], num_sampled=1)
    assert step_cost(DEV, w).comm_s == 0.0


def test_group_rates_and_comm_by_hand() -> None:
    group = DEV.tensor_parallel(2)
    assert group.name == "testx2" and group.tensor_parallel_size == 2
    assert group.dense_flops == 2000.0 and group.bandwidth == 2000.0
    assert group.memory_bytes == 2 * 10**6 and group.launch_s == DEV.launch_s
    w = step_work(TINY, [5, 7], [1, 3], num_sampled=2)  # T = 4 tokens
    assert w.num_allreduces == 2 * 2 + 1
    assert w.allreduce_bytes == 4 * 4 * 2  # T x hidden x bf16
    assert w.logits_bytes == 2 * 10 * 2  # S x V x bf16
    # ring all-reduce 2 (N-1)/N x 32 B / 64 B/s = 0.5 s each (+ latency); gather 1/2 x 40 / 64
    want = 5 * (0.01 + 0.5) + 0.01 + 0.5 * 40 / 64
    cost = step_cost(group, w)
    assert cost.comm_s == pytest.approx(want)
    one = step_cost(DEV, w)
    assert cost.compute_s == pytest.approx(one.compute_s / 2)
    assert cost.total_s == pytest.approx(cost.overhead_s + max(cost.compute_s, cost.memory_s)
                                         + want)  # fmt: skip


def test_nvlink_figures_and_a_70b_step_on_8_h200() -> None:
    h200 = DEVICES["h200"]
    assert h200.link_bandwidth == pytest.approx(450e9 * NVLINK_EFFICIENCY)
    assert DEVICES["h100"].link_bandwidth == h200.link_bandwidth
    cfg = SimConfig(device="h200", model="llama-3-70b", tensor_parallel_size=8)
    device, model = cfg.device_profile(), cfg.model_shape()
    decode = step_cost(device, step_work(model, [1024] * 64, [1] * 64, 64))
    # 64 decodes: 161 all-reduces of 64 x 8192 x 2 B; memory-bound on 1/8 of 141 GB per GPU
    assert 0 < decode.comm_s < decode.memory_s < 0.02
    single = step_cost(DEVICES["h200"], step_work(model, [1024] * 64, [1] * 64, 64))
    assert decode.total_s < single.total_s / 3  # N=8 is much faster despite the all-reduces


def test_refusals() -> None:
    with pytest.raises(ValueError, match="interconnect"):
        DEVICES["cpu-smollm2"].tensor_parallel(2)
    with pytest.raises(ValueError, match="does not divide"):
        SimConfig(model="smollm2-135m", tensor_parallel_size=2)
    assert SimConfig(model="smollm2-135m", device="none", tensor_parallel_size=3)
    with pytest.raises(ValueError):
        dataclasses.replace(DEV, link_bandwidth=0.0)
