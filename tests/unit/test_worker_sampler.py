"""The sampler on fixed logits: greedy, filters, penalties, seeded draws, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.held_batch import request_seed
from services.worker.sampler import SampleRow, draw_uniform, filter_logits, sample
from shared.protocol.sampling import SamplingParams

V = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def row(
    n: int = 0, seed: int = 1, history: list[int] | None = None, prompt_len: int = 0, **params
) -> SampleRow:
    return SampleRow(SamplingParams(**params), seed, n, history or [], prompt_len)


def test_draw_uniform_is_a_pure_function_in_range() -> None:
    us = [draw_uniform(s, n) for s in (0, 1, -5, 2**63 + 5) for n in range(200)]
    assert all(0.0 < u <= 1.0 for u in us)
    assert us == [draw_uniform(s, n) for s in (0, 1, -5, 2**63 + 5) for n in range(200)]
    assert len(set(us)) == len(us)
    mean = sum(us) / len(us)
    assert abs(mean - 0.5) < 0.05


def test_unseeded_requests_get_a_stable_seed_from_the_rid() -> None:
    assert request_seed("req-1", None) == request_seed("req-1", None) == 1829706545
    assert request_seed("req-1", 42) == 42


def test_greedy_is_argmax() -> None:
    x = logits_rows(4)
    tokens, _ = sample(x.clone(), [row(temperature=0.0) for _ in range(4)])
    assert tokens == x.argmax(dim=1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    x = logits_rows(6, seed=3)
    rows = [row(n=i, seed=i, temperature=1.5, top_k=1) for i in range(3)]
    rows += [row(n=i, seed=i, temperature=1.5, top_p=1e-6) for i in range(3)]
    tokens, _ = sample(x.clone(), rows)
    assert tokens == x.argmax(dim=1).tolist()


def test_filters_keep_exactly_the_expected_sets() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **p: torch.isfinite(filter_logits(x.clone(), [row(**p)]))[0].tolist()  # noqa
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(min_p=0.25) == [True, True, True, False]  # 0.05 < 0.25 * 0.5
    assert kept() == [True] * 4


def test_seeded_draw_reproducible_and_independent_of_batch() -> None:
    x = logits_rows(8, seed=5)
    target = row(n=3, seed=1234, temperature=0.8, top_p=0.95)
    alone, _ = sample(x[2:3].clone(), [target])
    others = [row(n=i, seed=i, temperature=1.0 + i / 10, top_k=5 + i) for i in range(8)]
    for pos in (0, 2, 7):
        batch = others[:pos] + [target] + others[pos + 1 :]
        xb = x.clone()
        xb[pos] = x[2]
        tokens, _ = sample(xb, batch)
        assert tokens[pos] == alone[0]


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = torch.log(probs).repeat(3000, 1)
    tokens, _ = sample(x, [row(n=i, seed=77, temperature=1.0) for i in range(3000)])
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_penalties() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    got = x.clone()
    hist = [0, 1, 2, 2]  # prompt [0, 1], outputs [2, 2]
    r = row(
        history=hist,
        prompt_len=2,
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    from services.worker.sampler import apply_penalties

    apply_penalties(got, [r])
    want = torch.tensor([[1.0, -2.0, 0.25 - 0.5 - 0.5, 0.0]])
    assert torch.allclose(got, want)


def test_logprobs_from_processed_distribution() -> None:
    x = logits_rows(2, seed=9)
    rows = [row(temperature=0.0, logprobs=4), row(temperature=2.0, logprobs=0, n=1, seed=3)]
    tokens, lps = sample(x.clone(), rows)
    lp0 = torch.log_softmax(x[0], dim=0)
    assert lps[0] is not None and lps[1] is not None
    assert lps[0].top_token_ids == torch.topk(lp0, 4).indices.tolist()
    assert lps[0].logprob == pytest.approx(float(lp0[tokens[0]]), abs=1e-5)
    assert lps[1].top_token_ids == [] and lps[1].logprob == pytest.approx(
        float(torch.log_softmax(x[1] / 2.0, dim=0)[tokens[1]]), abs=1e-5
    )
    assert not math.isnan(lps[1].logprob)
