"""Waiting-queue order and victim choice per policy, on hand-made requests."""

from __future__ import annotations

from services.scheduler.policy import WaitingQueue, pick_victim
from services.scheduler.request import Request
from tests.support.scheduler_requests import make_request


def _req(rid: str, seq_no: int, prompt_len: int, priority: int = 0, at: float = 0.0) -> Request:
    return make_request(rid, prompt_len, seq_no=seq_no, priority=priority, arrival_time=at)


def _order(q: WaitingQueue, now: float = 0.0) -> list[str]:
    return [r.rid for r in q.ordered(now)]


def test_fcfs_is_arrival_order_with_preempted_at_the_head() -> None:
    q = WaitingQueue("fcfs", max_wait=1.0)
    a, b, c = _req("a", 1, 9), _req("b", 2, 1), _req("c", 3, 5)
    for r in (a, b, c):
        q.add(r)
    assert _order(q) == ["a", "b", "c"]
    early, late = _req("p1", 0, 3), _req("p2", -1, 3)
    q.add_preempted(early)
    q.add_preempted(late)  # arrived even earlier: goes first among the preempted
    assert _order(q) == ["p2", "p1", "a", "b", "c"]
    q.remove(b)
    q.remove(early)
    assert _order(q) == ["p2", "a", "c"] and len(q) == 3


def test_priority_orders_by_value_then_arrival_and_requeues_by_key() -> None:
    q = WaitingQueue("priority", max_wait=1.0)
    for r in (
        _req("low", 1, 1, 5),
        _req("hi1", 2, 1, 0),
        _req("mid", 3, 1, 2),
        _req("hi2", 4, 1, 0),
    ):
        q.add(r)
    assert _order(q) == ["hi1", "hi2", "mid", "low"]
    q.add_preempted(_req("old-low", 0, 1, 9))
    assert _order(q)[-1] == "old-low"  # no jumping ahead of better priorities
    q.remove(next(r for r in q.ordered(0.0) if r.rid == "mid"))
    assert _order(q) == ["hi1", "hi2", "low", "old-low"]


def test_short_first_with_aging_puts_aged_requests_first_oldest_first() -> None:
    q = WaitingQueue("short-first", max_wait=10.0)
    q.add(_req("long-old", 1, 100, at=0.0))
    q.add(_req("mid-old", 2, 50, at=1.0))
    q.add(_req("short", 3, 2, at=5.0))
    q.add(_req("tiny", 4, 1, at=9.0))
    assert _order(q, now=5.0) == ["tiny", "short", "mid-old", "long-old"]
    assert _order(q, now=10.0) == ["long-old", "tiny", "short", "mid-old"]
    assert _order(q, now=11.0) == ["long-old", "mid-old", "tiny", "short"]
    assert q.oldest_arrival() == 0.0


def test_victim_is_the_policy_last_and_never_a_protected_one_if_avoidable() -> None:
    a, b, c = _req("a", 1, 1, priority=0), _req("b", 2, 1, priority=7), _req("c", 3, 1, 1)
    assert pick_victim("fcfs", [a, b, c]) is c
    assert pick_victim("priority", [a, b, c]) is b
    c.protected = True
    assert pick_victim("fcfs", [a, b, c]) is b
    a.protected = b.protected = True
    assert pick_victim("fcfs", [a, b, c]) is c  # all protected: still someone (no deadlock)
    assert pick_victim("fcfs", []) is None
