"""Adaptive draft limits (services/scheduler/draft_budget.py): the draft cost read from the
scheduler's step-time predictor is the step time it was fed, and the rule drafts where the
figures say drafts pay and nowhere else."""

from __future__ import annotations

import random

import pytest

from services.scheduler.draft_budget import BLIND_MISSES, EXPLORE_EVERY, MAX_BACKOFF, DraftBudget
from services.scheduler.request import Request
from shared.step_cost import StepCostPredictor, StepShape, step_shape
from tests.support.scheduler_requests import make_request

# The CPU's shape (docs/PERFORMANCE.md §8): ~57 ms a step plus ~2.2 ms per token computed.
CPU_A, CPU_B = 0.057, 0.0022


def _req(rid: str) -> Request:
    return make_request(rid)


def _shapes(sizes: list[int], drafts: int, seed: int) -> list[StepShape]:
    """Decode steps of `sizes[i]` rows at mixed contexts, half of them with `drafts` drafts
    on every row (drafted or not, a row's tokens are what the step computes)."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(sizes):
        starts = [rng.randint(8, 2000) for _ in range(n)]
        d = drafts if i % 2 else 0
        out.append(step_shape(starts, [1 + d] * n, n * (1 + d)))
    return out


def _fed(a: float, b: float, shapes: list[StepShape], noise: float = 0.0) -> StepCostPredictor:
    """A predictor fitted on steps that took a + b * (tokens computed), times (1 +- noise)."""
    predictor, rng = StepCostPredictor(window=len(shapes)), random.Random(7)
    for shape in shapes:
        t = (a + b * shape.num_tokens) * (1 + rng.uniform(-noise, noise))
        predictor.observe(shape, t)
    predictor.fit_now()
    return predictor


def _decodes(n: int, start: int = 500) -> StepShape:
    return step_shape([start] * n, [1] * n, n)


def test_the_draft_cost_is_the_one_the_predictor_was_fed() -> None:
    rng = random.Random(3)
    shapes = _shapes([rng.randint(1, 40) for _ in range(200)], drafts=4, seed=3)
    for n in (1, 8, 32):
        cost = DraftBudget(4, _fed(CPU_A, CPU_B, shapes, noise=0.03)).draft_cost(_decodes(n), n)
        assert cost is not None
        seconds, b = cost
        assert seconds == pytest.approx(CPU_A + CPU_B * n, rel=0.15)
        assert b == pytest.approx(CPU_B, rel=0.15)
    # and another machine's cost is not this one
    other = DraftBudget(4, _fed(0.010, 0.0005, shapes)).draft_cost(_decodes(8), 8)
    seconds, b = other or (0.0, 0.0)
    assert abs(b - CPU_B) > 0.5 * CPU_B and abs(seconds - (CPU_A + 8 * CPU_B)) > 0.5 * CPU_A


def test_the_draft_cost_waits_for_a_fit_and_never_makes_tokens_free() -> None:
    assert DraftBudget(4, StepCostPredictor()).draft_cost(_decodes(4), 4) is None
    # steps of one token per row only: the fit cannot tell a token's cost from the step's
    one_token_rows = [_decodes(4, start) for start in range(100, 140)]
    budget = DraftBudget(4, _fed(CPU_A, CPU_B, one_token_rows))
    seconds, b = budget.draft_cost(_decodes(4), 4) or (0.0, 0.0)
    assert b == pytest.approx(seconds / 4) and seconds == pytest.approx(CPU_A + 4 * CPU_B)


def _budget_on(a: float, b: float, max_drafts: int = 4) -> DraftBudget:
    shapes = _shapes([1, 2, 3, 4, 5, 8, 16, 32, 64, 128] * 3, drafts=max_drafts, seed=5)
    return DraftBudget(max_drafts, _fed(a, b, shapes))


def _learn(budget: DraftBudget, reqs: list[Request], accepted: int, rounds: int = 12) -> None:
    for _ in range(rounds):
        for r in reqs:
            budget.observe_row(r, 4, 4, accepted)


def test_one_stream_that_is_accepted_drafts_fully() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=4)
    assert budget.limits([r], _decodes(1)) == {id(r): 4}


def _tried(budget: DraftBudget, r: Request, steps: int, accepted: int) -> list[dict[int, int]]:
    """The limits of `steps` steps of one decode, its drafts (all offered) accepted so."""
    tried = []
    for _ in range(steps):
        chosen = budget.limits([r], _decodes(1))
        if chosen:
            tried.append(chosen)
            budget.observe_row(r, chosen[id(r)], chosen[id(r)], min(accepted, chosen[id(r)]))
    return tried


def test_drafts_that_are_never_accepted_stop() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=0)
    # only exploring steps draft, ever rarer while they miss: every 16 << 4 = 256 steps here
    tried = _tried(budget, r, 1024, accepted=0)
    assert len(tried) == 1024 // (EXPLORE_EVERY << MAX_BACKOFF)
    assert all(c == {id(r): 4} for c in tried)
    budget.observe_row(r, 4, 4, 1)  # one accepted: exploring every 16 steps again
    assert len(_tried(budget, r, 4 * EXPLORE_EVERY, accepted=1)) >= 4


def test_a_draft_that_always_misses_stops_before_the_first_fit() -> None:
    budget, r = DraftBudget(4, StepCostPredictor()), _req("a")
    tried = _tried(budget, r, 64, accepted=0)  # no fit in these 64 steps
    assert len(tried) == BLIND_MISSES  # as configured, until 8 rows in a row missed


def test_a_large_batch_on_a_token_bound_step_does_not_draft() -> None:
    # per token cost dominates (a=20 ms, b=2.6 ms): at 128 decodes a first draft accepted
    # half the time costs more than it gives; one that is always accepted pays
    budget = _budget_on(0.020, 0.0026)
    reqs = [_req(f"r{i}") for i in range(128)]
    for turn in range(12):
        _learn(budget, reqs, accepted=turn % 2, rounds=1)
    assert budget.limits(reqs, _decodes(128)) == {}
    _learn(budget, reqs, accepted=4, rounds=30)
    assert budget.limits(reqs, _decodes(128))
    # where the step is nearly all per-token cost (5 ms + 2.6 ms per token), even drafts
    # that are always accepted gain under 2%: none
    budget = _budget_on(0.005, 0.0026)
    _learn(budget, reqs, accepted=4, rounds=30)
    assert budget.limits(reqs, _decodes(128)) == {}


def test_one_stream_that_found_no_drafts_at_first_still_learns_the_slope() -> None:
    # at first nothing is proposed (one token per step: no slope to read); the exploring
    # steps give the line its slope once the text becomes repetitive
    predictor = StepCostPredictor()  # first fit after 64 steps, as in the scheduler
    budget, r = DraftBudget(4, predictor), _req("a")
    for step in range(8 * EXPLORE_EVERY):
        shape = _decodes(1, start=100 + step)
        drafts = budget.limits([r], shape).get(id(r), 0)
        proposed = drafts if step >= 2 * EXPLORE_EVERY else 0
        predictor.observe(shape.with_drafts([proposed]), CPU_A + CPU_B * (1 + proposed))
        predictor.maybe_refit()
        if drafts:
            budget.observe_row(r, drafts, proposed, proposed)
    assert predictor.fitted_multi_token_rows
    assert budget.limits([r], _decodes(1)) == {id(r): 4}


def test_a_limit_that_shrank_grows_again_when_its_drafts_keep_being_accepted() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    _learn(budget, [r], accepted=1)  # the first draft accepted, the second never
    assert budget.limits([r], _decodes(1)) == {id(r): 1}
    for _ in range(12):
        limit = budget.limits([r], _decodes(1))[id(r)]
        budget.observe_row(r, limit, limit, limit)  # now a verbatim copy: all accepted
    assert budget.limits([r], _decodes(1)) == {id(r): 4}


def test_a_proposer_that_offers_nothing_costs_nothing() -> None:
    budget, r = _budget_on(CPU_A, CPU_B), _req("a")
    for _ in range(12):
        budget.observe_row(r, 4, 0, 0)  # no n-gram match yet: nothing offered
    assert budget.limits([r], _decodes(1)) == {id(r): 4}  # its limit stays: when offered, accepted


def test_before_any_measurement_drafts_are_as_configured() -> None:
    budget, r = DraftBudget(3, StepCostPredictor()), _req("a")
    assert budget.limits([r], _decodes(1)) == {id(r): 3}
