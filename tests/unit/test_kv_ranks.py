"""A tensor-parallel KV hand-over (services/worker/kv_ranks.py, kv_transfer.py): each rank of a
prefill worker serves its own KV-head shard at its own address, and rank r of a decode worker
reads rank r's (real KvTransfer objects over real ZeroMQ sockets, simulated pools); a decode
worker with another number of ranks than the prefill worker's endpoint list refuses the pull
(the request recomputes) instead of reading a shard of other heads."""

from __future__ import annotations

import time

import structlog
import zmq

from services.worker.kv_ranks import rank_bind_address
from services.worker.kv_transfer import LEASE_UNKNOWN, TP_MISMATCH, KvTransfer, rank_endpoint
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KV_LINKS, SimKvPool
from shared.protocol.kv_channel import KvHandover
from shared.protocol.worker_channel import GrantLease, KvPulled, PullKv
from tests.bounds import SLOW_HOST_MARGIN_S


def _pool() -> SimKvPool:
    config = SimConfig(device="none", model="llama-3-8b")
    return SimKvPool(config.device_profile(), config.model_shape(), 16, KV_LINKS["free"])


def test_each_rank_binds_an_address_of_its_own() -> None:
    assert rank_bind_address("ipc:///run/worker-0-kv.sock", 0) == "ipc:///run/worker-0-kv.sock"
    assert rank_bind_address("ipc:///run/worker-0-kv.sock", 1) == "ipc:///run/worker-0-kv.sock-r1"
    assert rank_bind_address("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"  # any free port
    assert rank_bind_address("tcp://10.0.0.5:7000", 2) == "tcp://10.0.0.5:7002"
    assert rank_endpoint("tcp://a:1 tcp://a:2", 1, 2) == "tcp://a:2"
    assert rank_endpoint("tcp://a:1", 0, 1) == "tcp://a:1"
    assert rank_endpoint("tcp://a:1", 0, 2) is None and rank_endpoint("tcp://a:1 b", 0, 1) is None


def test_rank_r_pulls_from_rank_r_and_a_rank_count_mismatch_is_refused() -> None:
    context = zmq.Context()
    log = structlog.get_logger()
    prefill = [KvTransfer(_pool(), context, log, bind_addr="tcp://127.0.0.1:0", rank=r,
                          world_size=2) for r in range(2)]  # fmt: skip
    decode = [KvTransfer(_pool(), context, log, pull_timeout_s=5.0, rank=r, world_size=2)
              for r in range(2)]  # fmt: skip
    try:
        # only prefill rank 1 holds lease 1 (rank 0 a newer one, so a read of lease 1 is not
        # waited for): a decode rank reading another rank than its own is refused
        prefill[1].on_message(GrantLease(lease_id=1, generation=7, block_ids=[0, 1]))
        prefill[0].on_message(GrantLease(lease_id=2, generation=8, block_ids=[2, 3]))
        endpoints = " ".join(p.endpoint for p in prefill)
        ref = KvHandover(1, 7, [0, 1], 32, 16, kv_endpoint=endpoints)
        answers = [_pull(decode[r], prefill, PullKv("r", ref, [4, 5])) for r in range(2)]
        assert answers[1].ok and (answers[1].rank, answers[1].world_size) == (1, 2)
        assert answers[1].num_bytes == _pool().num_bytes(2)
        assert not answers[0].ok and answers[0].code == LEASE_UNKNOWN  # rank 0 read rank 0
        single = KvHandover(1, 7, [0, 1], 32, 16, kv_endpoint=prefill[1].endpoint)
        refused = _pull(decode[1], prefill, PullKv("s", single, [6, 7]))
        assert not refused.ok and refused.code == TP_MISMATCH and refused.world_size == 2
    finally:
        for t in prefill + decode:
            t.close()
        context.term()


def _pull(decode_side: KvTransfer, prefill: list[KvTransfer], pull: PullKv) -> KvPulled:
    """`pull` on `decode_side`, both sides' sockets served in this thread until it answers."""
    poller = zmq.Poller()
    for side in [decode_side, *prefill]:
        for sock in side.sockets():
            poller.register(sock, zmq.POLLIN)
    decode_side.on_message(pull)
    give_up = time.monotonic() + 10 + SLOW_HOST_MARGIN_S
    while time.monotonic() < give_up:
        for sock in decode_side.sockets():  # a new pull connection
            poller.register(sock, zmq.POLLIN)
        events = dict(poller.poll(10))
        for side in [decode_side, *prefill]:
            side.on_events(events)
        decode_side.tick(time.monotonic())
        if answers := decode_side.take_answers():
            return answers[0]
    raise AssertionError("no answer")
