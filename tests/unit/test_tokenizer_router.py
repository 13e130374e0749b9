"""The frontend's data-parallel router (services/tokenizer/router.py): each policy's choice,
the cache-aware overload rule, the load estimate, and what an engine's loss forgets; and the
fan-out of `stats` across engines (engine_queries.combine_stats)."""

from __future__ import annotations

import random

import pytest

from services.tokenizer.engine_queries import combine_stats
from services.tokenizer.router import ROUTER_BLOCK_LEN, EngineLoad, Router, RouterConfig


def _prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(num_tokens)]


def _route(router: Router, prompt: list[int], ready: list[int]) -> int:
    engine = router.choose(prompt, ready)
    assert engine is not None
    router.routed(engine, prompt)
    router.check_invariants()
    return engine


def test_round_robin_cycles_over_the_ready_engines() -> None:
    router = Router(RouterConfig("round-robin"), 3)
    picks = [_route(router, [1, 2, 3], [0, 1, 2]) for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert [_route(router, [1], [0, 2]) for _ in range(4)] == [0, 2, 0, 2]  # 1 is out
    assert router.choose([1], []) is None


def test_least_load_balances_and_counts_finished_requests() -> None:
    router = Router(RouterConfig("least-load"), 2)
    picks = [_route(router, [7], [0, 1]) for _ in range(10)]
    assert picks.count(0) == picks.count(1) == 5
    for _ in range(3):
        router.request_done(0)  # engine 0 now carries 2, engine 1 carries 5
    assert [_route(router, [7], [0, 1]) for _ in range(3)] == [0, 0, 0]


def test_load_estimate_adds_other_frontends_from_the_report() -> None:
    load = EngineLoad(num_local=2)
    assert load.estimate() == 2
    router = Router(RouterConfig("least-load"), 2)
    router.on_report(0, waiting=10, running=8, kv_usage=0.5)  # others' 18 requests on 0
    assert router.loads[0].estimate() == 18
    assert [_route(router, [1], [0, 1]) for _ in range(5)] == [1] * 5


def test_cache_aware_keeps_a_prefix_on_its_engine_and_spreads_new_ones() -> None:
    router = Router(RouterConfig("cache-aware"), 2)
    prefixes = [_prompt(seed, 8 * ROUTER_BLOCK_LEN) for seed in range(8)]
    where: dict[int, set[int]] = {p: set() for p in range(8)}
    for round_ in range(8):
        for p, prefix in enumerate(prefixes):
            tail = _prompt(1000 + 8 * round_ + p, 20)
            where[p].add(_route(router, prefix + tail, [0, 1]))
    assert all(len(engines) == 1 for engines in where.values())
    num_on_0 = sum(1 for engines in where.values() if engines == {0})
    assert num_on_0 == 4  # the first request of each prefix went by load


def test_cache_aware_sheds_an_overloaded_engine_and_never_starves_one() -> None:
    router = Router(RouterConfig("cache-aware", balance_abs=4, balance_rel=1.5), 2)
    hot = _prompt(1, 4 * ROUTER_BLOCK_LEN)
    picks = [_route(router, hot, [0, 1]) for _ in range(30)]
    first = picks[0]
    # the hot prefix stays on its engine until it carries > least + 4 and > 1.5x least
    assert picks[:5] == [first] * 5
    assert picks.count(1 - first) >= 10
    counts = [router.loads[e].num_local for e in (0, 1)]
    assert max(counts) <= min(counts) * 1.5 + 4 + 1


def test_short_prompts_and_lost_engines_match_nothing() -> None:
    router = Router(RouterConfig("cache-aware"), 2)
    long_prompt = _prompt(3, 4 * ROUTER_BLOCK_LEN)
    engine = _route(router, long_prompt, [0, 1])
    assert router.choose(long_prompt, [0, 1]) == engine  # the match wins over the tie
    router.engine_lost(engine)
    router.request_done(engine)
    router.check_invariants()
    # its picture is gone: least-load decides (ties rotate past the last choice)
    assert router.choose(long_prompt, [0, 1]) == 1 - engine
    short = [5] * (ROUTER_BLOCK_LEN - 1)  # no full block: nothing to match
    assert router.choose(short, [0, 1]) in (0, 1)


def test_auto_is_cache_aware_only_with_prefix_caching() -> None:
    router = Router(RouterConfig(), 2)
    assert router.cache_aware
    router.set_prefix_caching(False)
    assert not router.cache_aware


@pytest.mark.parametrize(
    "bad",
    [
        {"policy": "random"},
        {"balance_abs": -1},
        {"balance_rel": 0.5},
        {"min_match_blocks": 0},
    ],  # fmt: skip
)
def test_invalid_router_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**bad)  # type: ignore[arg-type]


def test_stats_of_several_engines_combine_as_one() -> None:
    a = {"num_running": 2.0, "kv_blocks_used": 10.0, "kv_blocks_total": 100.0, "kv_usage": 0.1,
         "prefix_cache_queries": 100.0, "prefix_cache_hits": 50.0, "prefix_cache_hit_rate": 0.5,
         "batch_utilization": 0.25, "ready": 1.0}  # fmt: skip
    b = {"num_running": 6.0, "kv_blocks_used": 90.0, "kv_blocks_total": 100.0, "kv_usage": 0.9,
         "prefix_cache_queries": 300.0, "prefix_cache_hits": 0.0, "prefix_cache_hit_rate": 0.0,
         "batch_utilization": 0.75, "ready": 0.0}  # fmt: skip
    out = combine_stats([a, b])
    assert out is not None
    assert out["num_running"] == 8.0 and out["kv_usage"] == pytest.approx(0.5)
    assert out["prefix_cache_hit_rate"] == pytest.approx(50 / 400)
    assert out["batch_utilization"] == pytest.approx(0.5) and out["ready"] == 1.0
    assert combine_stats([a]) == a and combine_stats([]) is None
