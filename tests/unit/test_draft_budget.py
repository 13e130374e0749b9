"""Adaptive draft limits (services/scheduler/draft_budget.py): the cost line recovers the step
time it is fed, and the rule drafts where the figures say drafts pay and nowhere else."""

from __future__ import annotations

import random

import pytest

from services.scheduler.draft_budget import EXPLORE_EVERY, DraftBudget, StepCostLine
from services.scheduler.request import Request
from shared.protocol.sampling import SamplingParams

# The CPU's shape (docs/PERFORMANCE.md §8): ~57 ms a step plus ~2.2 ms per token computed.
CPU_A, CPU_B = 0.057, 0.0022


def _req(rid: str) -> Request:
    return Request(
        rid=rid,
        token_ids=[5] * 8,
        num_prompt_tokens=8,
        sampling=SamplingParams(),
        priority=0,
        seq_no=0,
        arrival_time=0.0,
        max_len=1000,
        stop_ids=frozenset(),
    )


def _fed(a: float, b: float, sizes: list[int], noise: float = 0.0) -> StepCostLine:
    line, rng = StepCostLine(), random.Random(7)
    for n in sizes:
        line.observe(n, (a + b * n) * (1 + rng.uniform(-noise, noise)))
    return line


def test_cost_line_recovers_the_step_time_it_is_fed() -> None:
    rng = random.Random(3)
    sizes = [rng.randint(1, 160) for _ in range(200)]
    fit = _fed(CPU_A, CPU_B, sizes, noise=0.03).fit()
    assert fit is not None
    a, b = fit
    assert a == pytest.approx(CPU_A, rel=0.15) and b == pytest.approx(CPU_B, rel=0.15)
    # and another machine's line is not this one
    a2, b2 = _fed(0.010, 0.0005, sizes).fit() or (0.0, 0.0)
    assert abs(b2 - CPU_B) > 0.5 * CPU_B and abs(a2 - CPU_A) > 0.5 * CPU_A


def test_cost_line_waits_for_observations_and_never_makes_tokens_free() -> None:
    assert _fed(CPU_A, CPU_B, [4] * 3).fit() is None
    a, b = _fed(CPU_A, CPU_B, [4] * 20).fit() or (0.0, 0.0)
    assert a == 0.0 and b == pytest.approx((CPU_A + 4 * CPU_B) / 4)  # no spread: mean cost


def _budget_on(a: float, b: float, max_drafts: int = 4) -> DraftBudget:
    budget = DraftBudget(max_drafts)
    for n in [1, 2, 3, 4, 5, 8, 16, 32, 64, 128] * 3:
        budget.observe_step(n, a + b * n)
    return budget


def _learn(budget: DraftBudget, reqs: list[Request], accepted: int, rounds: int = 12) -> None:
    for _ in range(rounds):
        for r in reqs:
            budget.observe_row(r, 4, 4, accepted)


def test_one_stream_that_is_accepted_drafts_fully() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=4)
    assert budget.limits([r], 1) == {id(r): 4}


def test_drafts_that_are_never_accepted_stop() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=0)
    chosen = [budget.limits([r], 1) for _ in range(4 * EXPLORE_EVERY)]
    tried = [c for c in chosen if c]
    assert len(tried) == 4  # only the exploring steps
    assert all(c == {id(r): 4} for c in tried)


def test_a_large_batch_on_a_token_bound_step_does_not_draft() -> None:
    # per token cost dominates (a=20 ms, b=2.6 ms): at 128 decodes a first draft accepted
    # half the time costs more than it gives; one that is always accepted pays
    budget = _budget_on(0.020, 0.0026)
    reqs = [_req(f"r{i}") for i in range(128)]
    for turn in range(12):
        _learn(budget, reqs, accepted=turn % 2, rounds=1)
    assert budget.limits(reqs, 128) == {}
    _learn(budget, reqs, accepted=4, rounds=30)
    assert budget.limits(reqs, 128)
    # where the step is nearly all per-token cost (5 ms + 2.6 ms per token), even drafts
    # that are always accepted gain under 2%: none
    budget = _budget_on(0.005, 0.0026)
    _learn(budget, reqs, accepted=4, rounds=30)
    assert budget.limits(reqs, 128) == {}


def test_one_stream_that_found_no_drafts_at_first_still_learns_the_slope() -> None:
    # at first nothing is proposed (one token per step: no slope to read); the exploring
    # steps give the line its slope once the text becomes repetitive
    budget, r = DraftBudget(4), _req("a")
    for step in range(8 * EXPLORE_EVERY):
        drafts = budget.limits([r], 1).get(id(r), 0)
        proposed = drafts if step >= 2 * EXPLORE_EVERY else 0
        budget.observe_step(1 + proposed, CPU_A + CPU_B * (1 + proposed))
        if drafts:
            budget.observe_row(r, drafts, proposed, proposed)
    assert budget.limits([r], 1) == {id(r): 4}


def test_a_limit_that_shrank_grows_again_when_its_drafts_keep_being_accepted() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=1)  # the first draft accepted, the second never
    assert budget.limits([r], 1) == {id(r): 1}
    for _ in range(12):
        limit = budget.limits([r], 1)[id(r)]
        budget.observe_row(r, limit, limit, limit)  # now a verbatim copy: all accepted
    assert budget.limits([r], 1) == {id(r): 4}


def test_a_proposer_that_offers_nothing_costs_nothing() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    for _ in range(12):
        budget.observe_row(r, 4, 0, 0)  # no n-gram match yet: nothing offered
    assert budget.limits([r], 1) == {id(r): 4}  # its limit stays: when offered, accepted


def test_before_any_measurement_drafts_are_as_configured() -> None:
    budget, r = DraftBudget(3), _req("a")
    assert budget.limits([r], 1) == {id(r): 3}
