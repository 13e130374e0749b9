"""The simulated worker's KV hand-over (services/worker/sim/kv_link.py): the modelled times
follow the stated link and device rates, and two simulated workers' KvTransfer speak the real
protocol over a real ZeroMQ socket (a lease served, a wrong generation refused, a layout of
another model refused) while waiting the modelled time."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import structlog
import zmq

from services.worker.kv_transfer import KvLayoutError, KvTransfer
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KV_LINKS, SimKvPool, reads_during_steps
from shared.protocol.kv_channel import KvHandover
from shared.protocol.worker_channel import GrantLease, PullKv

LLAMA_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16


def pool(link: str = "infiniband", model: str = "llama-3-8b", device: str = "h200") -> SimKvPool:
    config = SimConfig(device=device, model=model)
    return SimKvPool(config.device_profile(), config.model_shape(), 16, KV_LINKS[link])


def test_the_modelled_times_follow_the_link_and_the_device() -> None:
    ib, nvlink = pool("infiniband"), pool("nvlink")
    num_blocks = 128  # 2,048 tokens: 268 MB of Llama-3-8B KV
    num_bytes = num_blocks * 16 * LLAMA_KV_PER_TOKEN
    assert ib.num_bytes(num_blocks) == num_bytes
    h200_kv = SimConfig().device_profile().kv_bandwidth
    assert h200_kv is not None
    assert ib.export_seconds(num_blocks) == pytest.approx(2 * num_bytes / h200_kv)
    wire = 20e-6 + num_bytes / (50e9 * 0.8)  # 400 Gb/s, 80% achieved
    assert ib.pull_seconds(num_blocks) == pytest.approx(wire + ib.export_seconds(num_blocks))
    assert 4e-3 < ib.pull_seconds(num_blocks) < 10e-3
    assert nvlink.pull_seconds(num_blocks) < ib.pull_seconds(num_blocks) / 5
    assert pool("free").pull_seconds(num_blocks) == ib.export_seconds(num_blocks)
    assert pool(device="none").pull_seconds(num_blocks) == 0.0


def test_a_payload_of_another_layout_is_refused() -> None:
    small = pool(model="smollm2-135m")
    out = small.export([1, 2])
    with pytest.raises(KvLayoutError):
        pool().load([3, 4], out.shape, out.dtype, out.payload)
    with pytest.raises(KvLayoutError):
        small.load([3], out.shape, out.dtype, out.payload)  # another block count


def test_two_simulated_workers_hand_over_through_real_sockets() -> None:
    context = zmq.Context()
    log = structlog.get_logger()
    prefill = KvTransfer(pool("ethernet"), context, log, bind_addr="tcp://127.0.0.1:0")
    decode = KvTransfer(pool("ethernet"), context, log)
    try:
        prefill.on_message(GrantLease(lease_id=1, generation=77, block_ids=[0, 1, 2]))
        ref = KvHandover(1, 77, [0, 1, 2], 48, 16, kv_endpoint=prefill.endpoint)
        served = _serve_while(prefill, decode, PullKv("r", ref, [10, 11, 12]))
        assert served.ok and served.num_bytes == 3 * 16 * LLAMA_KV_PER_TOKEN
        assert served.seconds >= pool("ethernet").pull_seconds(3)  # the modelled wait
        stale = KvHandover(1, 78, [0, 1, 2], 48, 16, kv_endpoint=prefill.endpoint)
        refused = _serve_while(prefill, decode, PullKv("s", stale, [10, 11, 12]))
        assert not refused.ok and refused.code == "lease_unknown"
    finally:
        prefill.close()
        decode.close()
        context.term()


def _serve_while(prefill: KvTransfer, decode: KvTransfer, pull: PullKv) -> Any:
    """The decode side's pull (blocking, as in its worker loop) while the prefill side's
    worker loop answers reads in a thread of its own."""
    stop = threading.Event()

    def serve() -> None:
        assert prefill.server is not None
        while not stop.is_set():
            if prefill.server.poll(10, zmq.POLLIN):
                prefill.on_readable()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        return decode.on_message(pull)
    finally:
        stop.set()
        thread.join()


def test_a_one_sided_prefill_worker_answers_reads_during_its_steps() -> None:
    # --sim-kv-one-sided: a read arriving while a simulated step runs is answered before the
    # step ends (a one-sided RDMA read needs no prefill compute), not after it
    context = zmq.Context()
    log = structlog.get_logger()
    prefill = KvTransfer(pool("nvlink"), context, log, bind_addr="tcp://127.0.0.1:0")
    decode = KvTransfer(pool("nvlink"), context, log)
    wait = reads_during_steps(prefill)
    assert wait is not None and reads_during_steps(decode) is None
    prefill.on_message(GrantLease(lease_id=1, generation=5, block_ids=[0, 1]))
    ref = KvHandover(1, 5, [0, 1], 32, 16, kv_endpoint=prefill.endpoint)
    step_ends = time.perf_counter() + 0.5  # a long prefill step
    step = threading.Thread(target=wait, args=(step_ends,))
    step.start()
    try:
        answer = decode.on_message(PullKv("r", ref, [4, 5]))
        assert answer is not None and answer.ok
        assert time.perf_counter() < step_ends  # served mid-step
    finally:
        step.join()
        prefill.close()
        decode.close()
        context.term()
