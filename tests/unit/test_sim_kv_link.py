"""The simulated worker's KV hand-over (services/worker/sim/kv_link.py): the modelled times
follow the stated link and device rates, and two simulated workers' KvTransfer speak the real
protocol over a real ZeroMQ socket (a lease served, a wrong generation refused, a layout of
another model refused, a silent prefill worker timed out) and report a pull the modelled time
after its reply landed; a one-sided prefill worker answers reads, and takes its lease grants
out of the plan stream, during its steps."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import structlog
import zmq

from services.worker.inbox import PlanInbox
from services.worker.kv_transfer import GRANT_WAIT_S, KvLayoutError, KvTransfer
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KV_LINKS, SimKvPool, kv_during_steps
from shared.protocol.codec import decode, encode
from shared.protocol.kv_channel import KvHandover, KvRead, KvReadReply
from shared.protocol.worker_channel import GrantLease, KvPulled, PullKv, WorkerShutdown
from tests.bounds import SLOW_HOST_MARGIN_S

LLAMA_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16


def pool(
    link: str = "infiniband", model: str = "llama-3-8b", device: str = "h200",
    one_sided: bool = False,
) -> SimKvPool:  # fmt: skip
    config = SimConfig(device=device, model=model)
    return SimKvPool(config.device_profile(), config.model_shape(), 16, KV_LINKS[link], one_sided)


def test_the_modelled_times_follow_the_link_and_the_device() -> None:
    ib, nvlink = pool("infiniband"), pool("nvlink")
    num_blocks = 128  # 2,048 tokens: 268 MB of Llama-3-8B KV
    num_bytes = num_blocks * 16 * LLAMA_KV_PER_TOKEN
    assert ib.num_bytes(num_blocks) == num_bytes
    h200_kv = SimConfig().device_profile().kv_bandwidth
    assert h200_kv is not None
    assert ib.export_seconds(num_blocks) == pytest.approx(2 * num_bytes / h200_kv)
    assert pool(one_sided=True).export_seconds(num_blocks) == 0.0  # RDMA reads: no gather
    wire = 20e-6 + num_bytes / (50e9 * 0.8)  # 400 Gb/s, 80% achieved
    assert ib.landing_seconds(num_blocks) == pytest.approx(wire + ib.copy_seconds(num_blocks))
    assert 4e-3 < ib.landing_seconds(num_blocks) < 10e-3
    assert nvlink.landing_seconds(num_blocks) < ib.landing_seconds(num_blocks) / 5
    assert pool("free").landing_seconds(num_blocks) == ib.copy_seconds(num_blocks)
    assert pool(device="none").landing_seconds(num_blocks) == 0.0
    assert SimConfig(kv_link="infiniband").one_sided_reads()
    assert not SimConfig(kv_link="ethernet").one_sided_reads()
    assert not SimConfig(kv_link="nvlink", kv_reads="two-sided").one_sided_reads()


def test_each_rank_of_a_tensor_parallel_group_moves_its_share_in_parallel() -> None:
    config = SimConfig(tensor_parallel_size=2)
    tp2 = SimKvPool(config.device_profile(), config.model_shape(), 16, KV_LINKS["infiniband"])
    num_blocks = 128
    num_bytes, scatter = tp2.num_bytes(num_blocks), tp2.copy_seconds(num_blocks)
    assert scatter == pytest.approx(pool().copy_seconds(num_blocks) / 2)  # 1/2 on each rank
    assert tp2.export([1, 2]).shape[3] == 2  # the reply says the prefill group's size
    half = 20e-6 + num_bytes / 2 / (50e9 * 0.8)  # each rank pair: half the bytes, own NIC
    assert tp2.landing_seconds(num_blocks, [num_blocks, 16, 1, 2]) == pytest.approx(half + scatter)
    assert tp2.landing_seconds(num_blocks) == pytest.approx(half + scatter)  # a group of ours
    whole = 20e-6 + num_bytes / (50e9 * 0.8)  # TP 1 -> 2: the one prefill GPU sends it all
    assert tp2.landing_seconds(num_blocks, [num_blocks, 16, 1, 1]) == pytest.approx(whole + scatter)


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
    decode_side = KvTransfer(pool("ethernet"), context, log, pull_timeout_s=0.3)
    try:
        prefill.on_message(GrantLease(lease_id=1, generation=77, block_ids=[0, 1, 2]))
        ref = KvHandover(1, 77, [0, 1, 2], 48, 16, kv_endpoint=prefill.endpoint)
        served = _serve_while(prefill, decode_side, [PullKv("r", ref, [10, 11, 12])])[0]
        assert served.ok and served.num_bytes == 3 * 16 * LLAMA_KV_PER_TOKEN
        assert served.seconds >= pool("ethernet").landing_seconds(3)  # the modelled landing
        stale = KvHandover(1, 78, [0, 1, 2], 48, 16, kv_endpoint=prefill.endpoint)
        silent = KvHandover(9, 1, [0], 16, 16, kv_endpoint="tcp://127.0.0.1:9")  # nobody there
        pulls = [PullKv("s", stale, [10, 11, 12]), PullKv("t", silent, [13])]
        answers = {a.rid: a for a in _serve_while(prefill, decode_side, pulls)}
        assert not answers["s"].ok and answers["s"].code == "lease_unknown"
        assert not answers["t"].ok and answers["t"].code == "timeout"
        assert decode_side.num_pulling() == 0
    finally:
        prefill.close()
        decode_side.close()
        context.term()


def _serve_while(prefill: KvTransfer, decode_side: KvTransfer, pulls: list[PullKv]) -> Any:
    """The decode side's pulls (started, then its sockets polled as its worker loop does)
    while the prefill side's worker loop answers reads in a thread of its own; the
    answers."""
    stop = threading.Event()

    def serve() -> None:
        assert prefill.server is not None
        while not stop.is_set():
            if prefill.server.poll(10, zmq.POLLIN):
                prefill.on_readable()

    thread = threading.Thread(target=serve)
    thread.start()
    poller = zmq.Poller()
    decode_side.attach(poller)
    answers: list[KvPulled] = []
    try:
        for pull in pulls:
            decode_side.on_message(pull)
        give_up = time.monotonic() + 10 + SLOW_HOST_MARGIN_S
        while len(answers) < len(pulls) and time.monotonic() < give_up:
            decode_side.on_events(dict(poller.poll(decode_side.wait_ms(100))))
            decode_side.tick(time.monotonic())
            answers += decode_side.take_answers()
        return answers
    finally:
        stop.set()
        thread.join()


def test_a_one_sided_prefill_worker_answers_reads_during_its_steps() -> None:
    # one-sided reads: a read arriving while a simulated step runs is answered before the step
    # ends (an RDMA read needs no prefill compute), and the lease's grant, queued on the plan
    # socket behind a plan, is taken out of it then; the plan stays for the loop, in order
    context = zmq.Context()
    log = structlog.get_logger()
    prefill = KvTransfer(pool("nvlink"), context, log, bind_addr="tcp://127.0.0.1:0")
    decode_side = KvTransfer(pool("nvlink"), context, log)
    scheduler, worker = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    scheduler.bind("inproc://plans")
    worker.connect("inproc://plans")
    inbox = PlanInbox(worker)
    prefill.attach(zmq.Poller(), inbox)
    wait = kv_during_steps(prefill, one_sided=True)
    step_ends = time.perf_counter() + 1.0  # a long prefill step
    step = threading.Thread(target=wait, args=(step_ends,))
    step.start()
    try:
        plan_like = encode(WorkerShutdown(reason="stands for the next plan"))
        scheduler.send(plan_like)
        scheduler.send(encode(GrantLease(lease_id=1, generation=5, block_ids=[0, 1])))
        ref = KvHandover(1, 5, [0, 1], 32, 16, kv_endpoint=prefill.endpoint)
        answer = _serve_while_stepping(decode_side, PullKv("r", ref, [4, 5]))
        assert answer is not None and answer.ok, answer
        assert time.perf_counter() < step_ends  # served mid-step
    finally:
        step.join()
    assert inbox.ready({}) and decode(inbox.recv()) == decode(plan_like)
    assert not inbox.ready({})
    for sock in (scheduler, worker):
        sock.close()
    prefill.close()
    decode_side.close()
    context.term()


def _serve_while_stepping(decode_side: KvTransfer, pull: PullKv) -> Any:
    poller = zmq.Poller()
    decode_side.attach(poller)
    decode_side.on_message(pull)
    give_up = time.monotonic() + 5
    while time.monotonic() < give_up:
        decode_side.on_events(dict(poller.poll(10)))
        decode_side.tick(time.monotonic())
        if answers := decode_side.take_answers():
            return answers[0]
    return None


def test_a_read_waits_for_a_grant_held_up_behind_a_long_step() -> None:
    # a read of a lease not granted yet waits (GRANT_WAIT_S); past that it is refused, but not
    # while scheduler frames wait unread: its GrantLease may be one of them (a long step ran)
    context = zmq.Context()
    log = structlog.get_logger()
    prefill = KvTransfer(pool("nvlink"), context, log, bind_addr="tcp://127.0.0.1:0")
    reader = context.socket(zmq.DEALER)
    reader.connect(prefill.endpoint)
    try:
        reader.send(encode(KvRead(lease_id=1, generation=5)))
        assert prefill.server is not None and prefill.server.poll(5000, zmq.POLLIN)
        prefill.on_readable()
        prefill.tick(time.monotonic() + 60, frames_waiting=True)  # the grant may be queued
        assert not reader.poll(100, zmq.POLLIN)
        prefill.on_message(GrantLease(lease_id=1, generation=5, block_ids=[0]))
        assert reader.poll(5000, zmq.POLLIN)
        head = decode(reader.recv_multipart()[0])
        assert isinstance(head, KvReadReply) and head.ok and head.lease_id == 1, head
        reader.send(encode(KvRead(lease_id=2, generation=6)))
        assert prefill.server.poll(5000, zmq.POLLIN)
        prefill.on_readable()
        time.sleep(GRANT_WAIT_S + 0.1)
        prefill.tick(time.monotonic())  # nothing unread: refused
        head = decode(reader.recv_multipart()[0])
        assert not head.ok and head.code == "lease_unknown" and head.lease_id == 2, head
    finally:
        reader.close(linger=0)
        prefill.close()
        context.term()
