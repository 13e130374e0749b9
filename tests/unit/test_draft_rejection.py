"""Rejection sampling keeps the target's distribution (services/worker/draft_rejection.py).

A tiny vocabulary, fixed target rows p_1..p_3 and draft rows q_1, q_2 unlike them; 12,000
rounds, each drawing two drafts from q and verifying them (>= 10,000 first drafts accepted). The
first emitted token must follow p_1, and the token emitted after an accepted first draft must
follow p_2: a chi-square goodness-of-fit test on each, passing when its p-value is above 1e-3
(fixed seeds: the test is deterministic; the correct rule gives 0.06 and 0.61). The same test
run on two wrong rules (accept with min(1, q/p); on rejection resample from p instead of the
residual) must give a p-value below 1e-3 (they give < 1e-30), so the test tells them apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.draft_rejection import inverse_cdf, rejection_sample

THRESHOLD = 1e-3  # a p-value below it rejects "the emitted tokens follow the target's p"
NUM_ROUNDS = 12_000
Rule = Callable[[torch.Tensor, torch.Tensor, list[int], torch.Generator], tuple[int, int]]

P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.10, 0.45, 0.20, 0.15, 0.05],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ],
    dtype=torch.float64,
)
Q = torch.tensor(
    [
        [0.30, 0.30, 0.15, 0.10, 0.05, 0.10],
        [0.30, 0.05, 0.15, 0.30, 0.05, 0.15],
    ],
    dtype=torch.float64,
)


def _wrong_rule(inverse_ratio: bool, residual_is_p: bool) -> Rule:
    """A rule with one of the classic mistakes, for showing that the test catches it."""

    def rule(p: torch.Tensor, q: torch.Tensor, ids: list[int], gen: torch.Generator):
        u = torch.rand(len(ids) + 1, generator=gen, dtype=torch.float64).tolist()
        for j, x in enumerate(ids):
            ratio = q[j, x] / p[j, x] if inverse_ratio else p[j, x] / q[j, x]
            if u[j] >= min(1.0, float(ratio)):
                residual = p[j] if residual_is_p else (p[j] - q[j]).clamp_min(0)
                return j, inverse_cdf(residual, u[-1])
        return len(ids), inverse_cdf(p[len(ids)], u[-1])

    return rule


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, V - 1 degrees of freedom: P(X >= the statistic)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _fit(rule: Rule) -> tuple[float, float, int]:
    """(p-value of the first token against p_1, of the second against p_2, second's draws)."""
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.stack([torch.multinomial(Q[j], NUM_ROUNDS, True, generator=gen) for j in (0, 1)])
    vocab = P.shape[1]
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    for ids in drafts.T.tolist():
        accepted, token = rule(P, Q, ids, gen)
        emitted = ids[:accepted] + [token]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    return _p_value(first, P[0]), _p_value(second, P[1]), int(second.sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    first, second, num_second = _fit(rejection_sample)
    assert num_second >= 10_000  # enough accepted first drafts for the second fit
    assert first > THRESHOLD and second > THRESHOLD, (first, second)


def test_the_fit_rejects_wrong_rules() -> None:
    inverse = _fit(_wrong_rule(inverse_ratio=True, residual_is_p=False))
    assert min(inverse[:2]) < THRESHOLD, inverse
    from_p = _fit(_wrong_rule(inverse_ratio=False, residual_is_p=True))
    assert min(from_p[:2]) < THRESHOLD, from_p


def test_every_draft_accepted_where_the_draft_is_the_target() -> None:
    gen = torch.Generator().manual_seed(7)
    p = torch.cat([Q, P[2:]])  # p_1, p_2 = q_1, q_2: min(1, p/q) = 1
    for _ in range(200):
        ids = [int(torch.multinomial(Q[j], 1, generator=gen)) for j in (0, 1)]
        assert rejection_sample(p, Q, ids, gen)[0] == 2
