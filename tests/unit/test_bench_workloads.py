"""Bench workloads (deterministic, promised length ranges) and arrival processes' statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.bench.arrivals import ArrivalConfig, arrival_offsets
from conveyor.bench.texts import TEXT_WORKLOADS
from conveyor.bench.workloads import (
    FIRST_PLAIN_TOKEN_ID,
    WORKLOADS,
    WorkloadConfig,
    generate,
    summarize,
)


@pytest.mark.parametrize("name", [w for w in WORKLOADS if w not in TEXT_WORKLOADS])  # texts: own
def test_same_seed_same_requests_other_seed_differs(name: str) -> None:
    a = generate(WorkloadConfig(name=name, num_prompts=20, seed=7))
    b = generate(WorkloadConfig(name=name, num_prompts=20, seed=7))
    c = generate(WorkloadConfig(name=name, num_prompts=20, seed=8))
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [r.index for r in a] == list(range(20))
    ids = np.concatenate([r.prompt_token_ids for r in a])
    assert ids.min() >= FIRST_PLAIN_TOKEN_ID and ids.max() < 49152


def test_mixed_lengths_cover_their_ranges() -> None:
    reqs = generate(WorkloadConfig(name="mixed", num_prompts=500, seed=1))
    ins = [r.prompt_len for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert 32 <= min(ins) < 50 and 495 < max(ins) <= 512
    assert 16 <= min(outs) < 25 and 245 < max(outs) <= 256
    assert abs(np.mean(ins) - 272) < 15 and abs(np.mean(outs) - 136) < 8


def test_uniform_is_exact_and_random_respects_range_ratio() -> None:
    uni = generate(WorkloadConfig(name="uniform", num_prompts=30, input_len=64, output_len=16))
    assert {r.prompt_len for r in uni} == {64} and {r.max_tokens for r in uni} == {16}
    cfg = WorkloadConfig(
        name="random", num_prompts=300, input_len=100, output_len=40, range_ratio=0.5
    )
    rnd = generate(cfg)
    assert min(r.prompt_len for r in rnd) >= 50 and max(r.prompt_len for r in rnd) <= 150
    assert min(r.max_tokens for r in rnd) >= 20 and max(r.max_tokens for r in rnd) <= 60
    assert len({r.prompt_len for r in rnd}) > 20


def test_shared_prefix_and_scale() -> None:
    cfg = WorkloadConfig(name="shared-prefix", num_prompts=10, input_len=8, prefix_len=40)
    reqs = generate(cfg)
    prefix = reqs[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix and r.prompt_len == 48 for r in reqs)
    assert len({tuple(r.prompt_token_ids[40:]) for r in reqs}) == 10
    half = generate(
        WorkloadConfig(name="uniform", num_prompts=3, input_len=64, output_len=16, scale=0.25)
    )
    assert {(r.prompt_len, r.max_tokens) for r in half} == {(16, 4)}


def test_multi_turn_resends_the_history_turn_by_turn() -> None:
    cfg = WorkloadConfig(
        name="multi-turn", num_prompts=9, num_turns=3, input_len=5, output_len=4, prefix_len=16
    )
    reqs = generate(cfg)
    assert [r.prompt_len for r in reqs] == [21] * 3 + [30] * 3 + [39] * 3
    system = reqs[0].prompt_token_ids[:16]
    assert all(r.prompt_token_ids[:16] == system for r in reqs)
    for conv in range(3):
        turns = [reqs[t * 3 + conv].prompt_token_ids for t in range(3)]
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later[: len(earlier)] == earlier  # the history is resent as it was
    assert reqs[3].prompt_token_ids[:21] != reqs[4].prompt_token_ids[:21]  # conversations differ
    capped = generate(WorkloadConfig(name="multi-turn", num_prompts=8, num_turns=4,
                                     input_len=50, output_len=50, prefix_len=10,
                                     max_model_len=260))  # fmt: skip
    assert len(capped) == 4 and all(r.prompt_len + r.max_tokens <= 260 for r in capped)


def test_chat_is_heavy_tailed_and_clipped() -> None:
    reqs = generate(WorkloadConfig(name="chat", num_prompts=2000, seed=3))
    ins = np.array([r.prompt_len for r in reqs])
    assert ins.min() >= 4 and ins.max() <= 2048
    assert np.percentile(ins, 99) > 6 * np.median(ins)  # a long tail, unlike mixed


def test_max_model_len_clips_prompt_plus_output() -> None:
    reqs = generate(WorkloadConfig(name="mixed", num_prompts=200, max_model_len=300))
    assert all(r.prompt_len + r.max_tokens <= 300 for r in reqs)
    assert summarize(reqs)["max_input_len"] <= 299


def test_bad_configs_are_rejected() -> None:
    for bad in ({"name": "nope"}, {"num_prompts": 0}, {"range_ratio": 1.0}, {"scale": 0},
                {"num_turns": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)
    for bad_arrival in ({"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0}):
        with pytest.raises(ValueError):
            ArrivalConfig(**bad_arrival)


def test_burst_sends_everything_at_once() -> None:
    cfg = ArrivalConfig()
    assert cfg.kind == "burst"
    assert arrival_offsets(cfg, 5) == [0.0] * 5


def test_poisson_gaps_have_the_rate_and_cv_one() -> None:
    cfg = ArrivalConfig(request_rate=20.0, seed=5)
    assert cfg.kind == "poisson"
    offsets = arrival_offsets(cfg, 20001)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.05) < 0.002
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.03
    assert arrival_offsets(cfg, 50) == arrival_offsets(cfg, 20001)[:50]


def test_gamma_burstiness_sets_the_coefficient_of_variation() -> None:
    for burstiness in (0.25, 4.0):
        cfg = ArrivalConfig(request_rate=10.0, burstiness=burstiness, seed=2)
        assert cfg.kind == "gamma"
        gaps = np.diff(arrival_offsets(cfg, 20001))
        assert abs(gaps.mean() - 0.1) < 0.006
        cv = gaps.std() / gaps.mean()
        assert abs(cv - 1 / math.sqrt(burstiness)) < 0.08
