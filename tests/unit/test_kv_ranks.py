"""A tensor-parallel KV hand-over (services/worker/kv_ranks.py, kv_transfer.py): each rank of a
prefill worker serves its own KV-head shard at its own address, and rank r of a decode worker
reads rank r's (real KvTransfer objects over real ZeroMQ sockets, simulated pools); a decode
worker with another number of ranks re-shards (kv_shards.py): each rank reads the slices of its
KV heads from the prefill ranks holding them (real torch pools: the blocks end up as one group's
would hold them), and refuses a pull it cannot re-shard (the request recomputes) instead of
reading a shard of other heads."""

from __future__ import annotations

import time

import pytest
import structlog
import torch
import zmq

from services.worker.kv_cache import KVCache
from services.worker.kv_pool import TensorKvPool
from services.worker.kv_ranks import rank_bind_address
from services.worker.kv_shards import ShardRead, can_reshard, shard_reads
from services.worker.kv_transfer import LEASE_UNKNOWN, TP_MISMATCH, KvTransfer
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KV_LINKS, SimKvPool
from services.worker.weights import ModelArgs
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


def test_a_decode_rank_reads_its_heads_from_the_prefill_ranks_holding_them() -> None:
    assert shard_reads("tcp://a:1 tcp://a:2", 1, 2, 1) == [ShardRead("tcp://a:2")]  # same size
    assert shard_reads("a", 1, 2, 2) == [ShardRead("a", 2, 2, 0)]  # TP 1 -> 2: half of rank 0
    assert shard_reads("a b", 0, 1, 4) == [ShardRead("a", 0, 2, 0), ShardRead("b", 0, 2, 2)]
    # 6 heads, TP 2 -> 3: decode rank 1 holds heads 2-3, prefill rank 0 has 0-2, rank 1 3-5
    assert shard_reads("a b", 1, 3, 2) == [ShardRead("a", 2, 1, 0), ShardRead("b", 0, 1, 1)]
    assert shard_reads("a b", 0, 1, 3) is None  # 3 heads do not split over 2 prefill ranks
    assert shard_reads("a b", 0, 1, None) is None and shard_reads("", 0, 1, 4) is None
    assert can_reshard(8, 2, 4) and can_reshard(6, 2, 3) and not can_reshard(6, 4, 3)


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
        # a pool without KV heads to slice (the simulated one) cannot re-shard: refused
        single = KvHandover(1, 7, [0, 1], 32, 16, kv_endpoint=prefill[1].endpoint)
        refused = _pull(decode[1], prefill, PullKv("s", single, [6, 7]))
        assert not refused.ok and refused.code == TP_MISMATCH and refused.world_size == 2
    finally:
        for t in prefill + decode:
            t.close()
        context.term()


ARGS = ModelArgs("LlamaForCausalLM", 32, 24, 48, 2, 6, 6, 4, 1e-5, 1e4, 64, False, False)


def _tensor_pool(world_size: int, fill: bool, rank: int = 0) -> tuple[TensorKvPool, KVCache]:
    """Rank `rank`'s pool of a group of `world_size` (6 KV heads in all, 4 blocks of 2);
    `fill`: block b, head h (of all 6), layer l, K/V kv holds 1000 b + 100 h + 10 l + kv."""
    heads = ARGS.num_kv_heads // world_size
    args = ModelArgs(**{**{f: getattr(ARGS, f) for f in ARGS.__dataclass_fields__},
                        "num_kv_heads": heads})  # fmt: skip
    cache = KVCache(args, 4, 2, "float32", "cpu")
    if fill:
        code = torch.zeros(2, 2, 4, 2, heads, 4)
        for b in range(4):
            for h in range(heads):
                code[:, :, b, :, h] = 1000 * b + 100 * (rank * heads + h)
        code += torch.arange(2).view(2, 1, 1, 1, 1, 1) * 10 + torch.arange(2).view(1, 2, 1, 1, 1, 1)
        cache.scatter([0, 1, 2, 3], code)
    return TensorKvPool(cache), cache


@pytest.mark.parametrize(("prefill_size", "decode_size"), [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_a_tp_size_mismatch_is_re_sharded(prefill_size: int, decode_size: int) -> None:
    context = zmq.Context()
    log = structlog.get_logger()
    sources = [_tensor_pool(prefill_size, True, r) for r in range(prefill_size)]
    prefill = [KvTransfer(sources[r][0], context, log, bind_addr="tcp://127.0.0.1:0", rank=r,
                          world_size=prefill_size) for r in range(prefill_size)]  # fmt: skip
    targets = [_tensor_pool(decode_size, False) for _ in range(decode_size)]
    decode = [KvTransfer(targets[r][0], context, log, pull_timeout_s=5.0, rank=r,
                         world_size=decode_size) for r in range(decode_size)]  # fmt: skip
    try:
        for side in prefill:
            side.on_message(GrantLease(lease_id=1, generation=7, block_ids=[1, 3]))
        ref = KvHandover(1, 7, [1, 3], 4, 2, kv_endpoint=" ".join(p.endpoint for p in prefill))
        for r in range(decode_size):
            answer = _pull(decode[r], prefill, PullKv("r", ref, [2, 0]))
            assert answer.ok and answer.num_bytes == targets[r][1].num_bytes // 2, answer
            want = _tensor_pool(decode_size, True, r)[1].gather([1, 3])
            assert torch.equal(targets[r][1].gather([2, 0]), want), f"decode rank {r}"
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
