"""Scheduling policies: the order of the waiting queue and the choice of a preemption victim.

* `fcfs`: arrival order.
* `priority`: lower `priority` first, ties by arrival.
* `short-first`: shortest prompt first (the seeds' "prefill_first").
* `slo`: least TTFT slack first, best-effort requests last (slo_policy.py, which also decides
  admission by latency targets).
* `lpm`: longest cached prefix first (SGLang's name). The cached prefix of a waiting request
  changes as the cache fills and evicts, so the order is computed afresh by `ordered()`, from
  each request's cached length as last found: while no cached block has been dropped since
  (the cache's `version`), that prefix is still there and only its continuation is looked up,
  so a step costs O(waiting) dictionary lookups, not O(waiting x prompt blocks).

Aging, for every sorted policy: a request that has waited `max_wait` seconds goes before every
un-aged one, oldest first, so no request waits much past `max_wait` because of the order (only
for a free slot, budget or blocks): no stream of high-priority or short requests starves it.
The same rule holds when the scheduler makes room for a better-ranked request (`is_aged`).

Requests preempted under fcfs, short-first, slo or lpm go back to the head of the queue (their
work is partly done and they arrived earlier than anyone behind them). Under priority they rejoin by
their key, so a preempted low-priority request cannot jump ahead of a higher-priority one.

The victim is the request the policy ranks last: the latest arrival (fcfs, short-first) or the
worst (priority, arrival) (priority).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Optional, Protocol

from services.scheduler.request import Request, RequestStatus
from services.scheduler.slo_policy import sort_key


class CachedPrefixes(Protocol):
    """What `lpm` asks the prefix cache (services/scheduler/prefix_cache.py)."""

    def version(self) -> tuple[int, int]:
        """(cached blocks dropped, blocks registered), both counted since start."""
        ...

    def cached_len(self, req: Request, known_len: int = 0) -> int:
        """Tokens of `req`'s prompt found cached now; `known_len` of them were found cached
        earlier and none has been dropped since (only what follows is looked up)."""
        ...

    def registered_len(self, req: Request) -> int:
        """Tokens of `req`'s prompt registered now (read-only: for `check_invariants`)."""
        ...


def victim_key(policy: str, req: Request) -> tuple[int, int]:
    """Larger is a better victim."""
    if policy == "priority":
        return (req.priority, req.seq_no)
    return (0, req.seq_no)


def pick_victim(
    policy: str,
    candidates: Iterable[Request],
    worse_than: Request | None = None,
    spare_protected: bool = False,
) -> Request | None:
    """The unprotected candidate ranked last by `policy`, else (unless `spare_protected`)
    the last protected one; only candidates ranked below `worse_than` when it is given.

    Taking blocks only from requests ranked below oneself is what guarantees progress: the
    best-ranked request can always take what it needs, finishes, and frees its blocks.
    A request just resumed after preemption is protected until it samples again, so it is not
    thrown out right after paying for its recompute (preemption thrash).
    """
    floor = None if worse_than is None else victim_key(policy, worse_than)
    best: Request | None = None
    best_protected: Request | None = None
    for req in candidates:
        if floor is not None and victim_key(policy, req) <= floor:
            continue
        if req.protected:
            if best_protected is None or victim_key(policy, req) > victim_key(
                policy, best_protected
            ):
                best_protected = req
        elif best is None or victim_key(policy, req) > victim_key(policy, best):
            best = req
    return best if best is not None or spare_protected else best_protected


class WaitingQueue:
    """Requests waiting for admission, iterated in policy order by `ordered(now)`.

    Add and remove are O(1) for fcfs and lpm, O(log n) + a memmove for the sorted policies.
    """

    def __init__(
        self,
        policy: str,
        max_wait: float,
        cache: Optional[CachedPrefixes] = None,
    ) -> None:
        """`cache`: the prefix cache, whose cached prefix lengths `lpm` orders by."""
        if policy == "lpm" and cache is None:
            raise ValueError("the lpm policy needs the prefix cache")
        self.policy = policy
        self.max_wait = max_wait
        self._cache = cache
        # lpm: rid -> (cache version, cached len) when last found, for waiting requests
        self._cached: dict[str, tuple[tuple[int, int], int]] = {}
        self._sorts = policy in ("priority", "short-first", "slo")  # keeps `_sorted` up to date
        self._head: deque[Request] = deque()  # preempted (fcfs, short-first), oldest first
        self._by_arrival: dict[str, Request] = {}  # everyone not in _head, in arrival order
        # (key, seq_no, req) for sorted policies
        self._sorted: list[tuple[tuple[float, ...], int, Request]] = []

    def __len__(self) -> int:
        return len(self._head) + len(self._by_arrival)

    def __contains__(self, req: Request) -> bool:
        return req.rid in self._by_arrival or req in self._head

    def _key(self, req: Request) -> tuple[float, ...]:
        if self.policy == "slo":
            return sort_key(req)
        return (req.priority if self.policy == "priority" else req.num_prompt_tokens,)

    def add(self, req: Request) -> None:
        """A new request: joins in policy order."""
        self._by_arrival[req.rid] = req
        if self._sorts:
            bisect.insort(self._sorted, (self._key(req), req.seq_no, req))

    def add_preempted(self, req: Request) -> None:
        """A preempted request: back to the head (fcfs, short-first) or by its key (priority)."""
        if self.policy == "priority":
            # By key, not at the head. (It lands at the end of `_by_arrival`; only dynamic and
            # static batching read arrival order there, and they never requeue.)
            self.add(req)
            return
        i = 0  # keep the head in arrival order when several are preempted
        while i < len(self._head) and self._head[i].seq_no < req.seq_no:
            i += 1
        self._head.insert(i, req)

    def remove(self, req: Request) -> None:
        self._cached.pop(req.rid, None)
        if self._by_arrival.pop(req.rid, None) is None:
            self._head.remove(req)
            return
        if self._sorts:
            item = (self._key(req), req.seq_no, req)
            i = bisect.bisect_left(self._sorted, item[:2], key=lambda t: t[:2])
            del self._sorted[i]

    def find(self, rid: str) -> Optional[Request]:
        """The waiting request `rid`, if it waits (changes nothing)."""
        req = self._by_arrival.get(rid)
        return req if req is not None else next((r for r in self._head if r.rid == rid), None)

    def known_cached_lens(self) -> dict[str, tuple[tuple[int, int], int]]:
        """lpm's memo, rid -> (cache version, cached len) when last found (read-only)."""
        return self._cached

    def check_invariants(self) -> None:
        """Raise AssertionError unless every waiting request is WAITING and holds no blocks,
        and lpm's memo holds: a remembered rid waits; while no cached block was dropped since,
        the remembered prefix is still registered, and with no registration since either, it is
        exactly what is registered. Read-only."""
        for req in [*self._head, *self._by_arrival.values()]:
            assert req.status is RequestStatus.WAITING and not req.block_ids, req.rid
        if self._sorts:
            assert len(self._sorted) == len(self._by_arrival), "the sorted list is stale"
        if self._cache is None:
            return
        dropped, registered = self._cache.version()
        for rid, ((was_dropped, was_registered), n) in self._cached.items():
            req = self.find(rid)
            assert req is not None, f"lpm remembers {rid}, which does not wait"
            if was_dropped != dropped:
                continue  # stale: looked up afresh next time
            found = self._cache.registered_len(req)
            assert n <= found, f"{rid}: lpm remembers {n} cached tokens, {found} are"
            if was_registered == registered:
                assert n == found, f"{rid}: lpm remembers {n} cached tokens, {found} are"

    def oldest_arrival(self) -> float | None:
        times = [self._head[0].arrival_time] if self._head else []  # head is in arrival order
        first = next(iter(self._by_arrival.values()), None)
        if first is not None:
            times.append(first.arrival_time)
        return min(times) if times else None

    def is_aged(self, req: Request, now: float) -> bool:
        """It arrived `max_wait` or more ago: it ranks before every un-aged request."""
        return now - req.arrival_time >= self.max_wait

    def ordered(self, now: float) -> Iterator[Request]:
        """Waiting requests, best first. Do not add or remove while iterating."""
        yield from self._head
        if self.policy == "fcfs":
            yield from self._by_arrival.values()
            return
        aged: set[str] = set()
        for req in self._by_arrival.values():  # arrival order: the aged form a prefix
            if not self.is_aged(req, now):
                break
            aged.add(req.rid)
            yield req
        if self.policy == "lpm":
            yield from self._longest_prefix_first(aged)
            return
        for _, _, req in self._sorted:
            if req.rid not in aged:
                yield req

    def _longest_prefix_first(self, aged: set[str]) -> list[Request]:
        """The un-aged requests, longest cached prefix first, ties by arrival."""
        cache = self._cache
        assert cache is not None  # checked in __init__
        rest = [r for r in self._by_arrival.values() if r.rid not in aged]
        version = cache.version()
        memo = self._cached
        lengths: dict[str, int] = {}
        for r in rest:
            seen = memo.get(r.rid)
            if seen is None or seen[0][0] != version[0]:  # new, or a cached block was dropped
                n = cache.cached_len(r)
            elif seen[0][1] != version[1]:  # blocks registered since: may extend it
                n = cache.cached_len(r, seen[1])
            else:
                n = seen[1]
            memo[r.rid] = (version, n)
            lengths[r.rid] = n
        rest.sort(key=lambda r: (-lengths[r.rid], r.seq_no))
        return rest
