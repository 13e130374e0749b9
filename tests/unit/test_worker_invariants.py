"""Each owner of the worker's state checks its own invariants (read-only `check_invariants`),
and the checks catch what they claim: the held batch (its sequences), the KV cache (the use the
held block tables make of it), the pipeline (placeholders of samples still on the device), and
the rule that decides whether launching ahead pays. The runner-level call over a real model is
exercised in test_worker_runner.py and test_worker_pipeline.py, between steps."""

from __future__ import annotations

import pytest
import torch

from services.worker.held_batch import PENDING_TOKEN, HeldBatch
from services.worker.kv_cache import KVCache
from services.worker.pipeline import LaunchedStep, OverlapRule, check_pending
from services.worker.plan_writer import PlanWriter
from services.worker.weights import ModelArgs
from shared.protocol.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BLOCK = 4


def _held() -> tuple[HeldBatch, PlanWriter]:
    """Two sequences: "a" (10 tokens, all computed), "b" (6 tokens, 4 computed)."""
    held = HeldBatch(num_blocks=16, block_size=BLOCK, max_model_len=64)
    writer = PlanWriter()
    a = writer.new_sequence("a", list(range(10, 20)), 10, [3, 4, 5], GREEDY)
    b = writer.new_sequence("b", list(range(30, 36)), 6, [7, 8], GREEDY)
    held.apply(writer.plan({"a": 10, "b": 4}, [a, b]))
    return held, writer


def _seq(held: HeldBatch, rid: str):
    return next(s for s in held.seqs.values() if s.rid == rid)


def test_held_batch_invariants_hold_and_catch_each_break() -> None:
    held, _ = _held()
    held.check_invariants()
    breaks = [
        lambda s: setattr(s, "num_computed", len(s.token_ids) + 1),  # past its history
        lambda s: s.block_ids.pop(),  # its table no longer covers what it computed
        lambda s: s.block_ids.append(16),  # outside the pool
        lambda s: s.token_ids.__setitem__(0, PENDING_TOKEN),  # a placeholder in the prompt
        lambda s: setattr(s, "slot", s.slot + 5),  # held under another slot
    ]
    for brk in breaks:
        held, _ = _held()
        brk(_seq(held, "a"))
        with pytest.raises(AssertionError):
            held.check_invariants()


def _kv() -> KVCache:
    args = ModelArgs("LlamaForCausalLM", 10, 8, 16, 2, 2, 1, 4, 1e-5, 1e4, 64, True, False)
    return KVCache(args, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")


def test_kv_cache_block_use_allows_only_full_shared_prefixes() -> None:
    kv = _kv()
    kv.check_invariants([([3, 4, 5], 10), ([7, 8], 4)])
    kv.check_invariants([([3, 4, 5], 10), ([3, 4, 9], 9)])  # a prefix hit: blocks 3, 4 full
    bad = [
        [([3, 4, 5], 10), ([3, 4], 5)],  # block 4 shared, not full in the second table
        [([3, 4, 5], 12), ([3, 5], 8)],  # block 5 shared at another index
        [([3, 4, 5], 12), ([5], 4)],
        [([3, 16], 5)],  # outside the pool
        [([3, -1], 5)],
    ]
    for tables in bad:
        with pytest.raises(AssertionError):
            kv.check_invariants(tables)


def _launched(held: HeldBatch, writer: PlanWriter) -> LaunchedStep:
    """The next step (a's decode, b's last 2 prompt tokens) launched as the runner does it,
    its samples pending on the device."""
    step = held.apply(writer.plan({"a": 1, "b": 2}))
    sampled = step.sampled()
    positions = held.reserve_samples(sampled)
    tokens = torch.tensor([41, 42])
    return LaunchedStep(step, sampled, positions, 0.0, tokens, tokens, None, [None, None])


def test_pending_samples_belong_to_a_launched_step() -> None:
    held, writer = _held()
    held.record_samples([_seq(held, "a")], [40])  # a sampled at the first step
    launched = _launched(held, writer)
    held.check_invariants()
    check_pending(held, [launched])
    with pytest.raises(AssertionError):
        check_pending(held, [])  # placeholders no launched step accounts for
    held.land_samples(launched.sampled, launched.positions, [41, 42])
    launched.token_ids = [41, 42]
    check_pending(held, [launched])
    check_pending(held, [])
    assert _seq(held, "a").token_ids[-1] == 41 and _seq(held, "b").token_ids[-1] == 42


def test_a_batch_awaiting_reset_may_keep_placeholders() -> None:
    held, writer = _held()
    held.record_samples([_seq(held, "a")], [40])
    _launched(held, writer)
    held.fail()  # the step's tokens never landed
    assert held.needs_reset
    check_pending(held, [])


def test_overlap_rule_follows_the_measured_share_with_hysteresis() -> None:
    rule = OverlapRule(forced=False)
    assert rule.overlaps()  # nothing measured yet (and never on a CPU)
    rule.on_step(0.001, None)
    assert rule.overlaps() and rule.share is None
    rule.on_step(0.0005, 0.1)  # 0.5% of the forward: not worth it
    assert not rule.overlaps()
    for _ in range(10):
        rule.on_step(0.0015, 0.1)  # 1.5%: between the bars, stays off
    assert not rule.overlaps()
    for _ in range(200):
        rule.on_step(0.005, 0.1)  # 5%: the average crosses 2%
    assert rule.overlaps() and rule.share is not None and rule.share > 0.04
    for _ in range(10):
        rule.on_step(0.0015, 0.1)  # back to 1.5%: stays on above 1%
    assert rule.overlaps()
    forced = OverlapRule(forced=True)
    forced.on_step(0.0, 1.0)
    assert forced.overlaps()
