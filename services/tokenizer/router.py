"""Which engine gets a new request: the frontend's data-parallel router (no extra hop).

Policies (`--router-policy`):

* `round-robin`: the next ready engine in turn.
* `least-load`: the ready engine with the lowest load estimate (`EngineLoad.estimate`): the
  requests the engine last reported waiting + running, corrected by what this frontend sent it
  since (its own in-flight count moves at once, the report once per heartbeat). Ties go to the
  engine after the last one chosen, so idle engines share work and two frontends that see the
  same picture do not both pile onto engine 0.
* `cache-aware`: the ready engine most likely to hold the prompt's prefix in its prefix cache,
  unless that engine is overloaded; else `least-load`. The frontend keeps an approximate
  picture of each engine's cache: the block keys (shared/prefix_hash.py, the scheduler's own
  key function) of the prompts it routed there, LRU-bounded. "Overloaded" means both
  load > least load + `balance_abs` and load > least load * `balance_rel` (SGLang's router
  uses the same two-threshold idea): a hot prefix may pile up a little on its engine, never
  without bound. The picture of an engine is dropped when it goes away (its cache is gone).

A request with latency targets (`ttft_ms`, `tpot_ms`) is routed by the same rule among the
engines not predicted to miss them, from what each engine reports (router_targets.py).

Several frontends each keep their own picture; their choices may differ, and each one still
balances by load, so none can starve an engine. Kept free of sockets: engines.py feeds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from services.tokenizer.router_targets import LatencyReport, engines_to_consider
from shared.prefix_hash import cache_namespace, extend_block_keys
from shared.protocol.client_channel.messages import LatencyTargets

POLICIES = ("round-robin", "least-load", "cache-aware")
AUTO = "auto"  # cache-aware while the engines cache prefixes, else least-load
ROUTER_BLOCK_LEN = 16  # tokens per hashed block: the scheduler's default block size
MAX_TRACKED_BLOCKS = 200_000  # LRU bound of the prefix picture (~16 B key + entry each)
_NAMESPACE = cache_namespace("router", "any")  # routing keys never meet the scheduler's


@dataclass
class EngineLoad:
    """What the router knows of one engine's load. `reported_*` come from the engine (every
    heartbeat); `num_local` is this frontend's requests on it now, and `num_local_at_report`
    what it was when the report came (so the report's share of other frontends is known)."""

    num_local: int = 0
    reported_waiting: int = 0
    reported_running: int = 0
    kv_usage: float = 0.0
    num_local_at_report: int = 0
    latency: Optional[LatencyReport] = None  # what it predicts for a new request (slo policy)

    @property
    def num_sent_since_report(self) -> int:
        """This frontend's requests sent to the engine after its last report (net of ends)."""
        return max(0, self.num_local - self.num_local_at_report)

    def estimate(self) -> int:
        """Requests on the engine now, as well as this frontend can tell."""
        others = self.reported_waiting + self.reported_running - self.num_local_at_report
        return self.num_local + max(0, others)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = field(
        default=AUTO,
        metadata={"choices": (AUTO, *POLICIES), "help": "which engine gets a request: auto "
                  "(cache-aware while the engines cache prefixes, else least-load), round-robin, "
                  "least-load, cache-aware"},
    )  # fmt: skip
    balance_abs: int = field(
        default=32,
        metadata={"help": "cache-aware: a prefix's engine is overloaded (least-load decides) "
                  "once it carries this many requests more than the least loaded engine and "
                  "balance_rel times as many"},
    )  # fmt: skip
    balance_rel: float = field(
        default=1.5, metadata={"help": "cache-aware: see balance_abs (a factor >= 1)"}
    )
    min_match_blocks: int = field(
        default=1, metadata={"help": "cache-aware: fewer matched blocks than this is no match"}
    )

    def __post_init__(self) -> None:
        if self.policy not in (AUTO, *POLICIES):
            raise ValueError(f"router policy must be one of {AUTO}, {', '.join(POLICIES)}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")
        if self.min_match_blocks < 1:
            raise ValueError("min_match_blocks must be >= 1")


class Router:
    """Call `choose` for each new request (with the engines ready now), then `routed` once it
    was sent; `request_done` when it ends, `engine_lost` when an engine goes away.

    `loads` is read-only for callers. Invariant: `loads[e].num_local` is the number of this
    frontend's requests routed to engine `e` and not done yet (never negative)."""

    def __init__(self, config: RouterConfig, num_engines: int) -> None:
        self.config = config
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self._last: int = -1  # the engine chosen last (round-robin and tie-breaks)
        self._prefix_caching = True  # what the engines report (EngineReady); for AUTO
        # block key -> engines that were sent a prompt with this block (LRU order)
        self._blocks: OrderedDict[bytes, set[int]] = OrderedDict()

    def choose(
        self,
        prompt_ids: Sequence[int],
        ready: Sequence[int],
        by_load: bool = False,
        targets: Optional[LatencyTargets] = None,
    ) -> Optional[int]:
        """The engine for a prompt among `ready` (engine indexes); None when none is ready.
        `by_load`: least-load whatever the policy (a decode engine for a hand-over: the
        prompt's KV comes with it, so where its prefix is cached does not matter).
        `targets`: the request's own; engines predicted to miss them are passed over while
        another is left (router_targets.py)."""
        if not ready:
            return None
        if targets is not None:  # the engines' reports walked only for a request with targets
            ready = engines_to_consider(
                ready, [load.latency for load in self.loads],
                [load.num_sent_since_report for load in self.loads], len(prompt_ids), targets,
            )  # fmt: skip
        if by_load:
            return self._least_loaded(ready)
        if self.config.policy == "round-robin":
            return self._next_after(self._last, ready)
        if self.cache_aware:
            best = self._best_match(prompt_ids, ready)
            if best is not None and not self._overloaded(best, ready):
                return best
        return self._least_loaded(ready)

    def routed(self, engine: int, prompt_ids: Sequence[int]) -> None:
        """`engine` was sent this prompt: it holds (or soon will) the prompt's blocks."""
        self._last = engine
        self.loads[engine].num_local += 1
        if not self.cache_aware:
            return
        for key in self._keys(prompt_ids):
            holders = self._blocks.pop(key, set())
            holders.add(engine)
            self._blocks[key] = holders  # most recently used last
        while len(self._blocks) > MAX_TRACKED_BLOCKS:
            self._blocks.popitem(last=False)

    def request_done(self, engine: int) -> None:
        """One of this frontend's requests on `engine` ended (any way)."""
        load = self.loads[engine]
        load.num_local = max(0, load.num_local - 1)

    def on_report(
        self,
        engine: int,
        waiting: int,
        running: int,
        kv_usage: float,
        latency: Optional[LatencyReport] = None,
    ) -> None:
        """The engine's own load figures (with its heartbeat answer) and, under its slo policy,
        what it predicts for a new request."""
        load = self.loads[engine]
        load.reported_waiting, load.reported_running, load.kv_usage = waiting, running, kv_usage
        load.num_local_at_report = load.num_local
        load.latency = latency

    def engine_lost(self, engine: int) -> None:
        """The engine went away: its cache and load figures are gone with it."""
        self.loads[engine] = EngineLoad(num_local=self.loads[engine].num_local)
        for key in [k for k, holders in self._blocks.items() if engine in holders]:
            holders = self._blocks[key]
            holders.discard(engine)
            if not holders:
                del self._blocks[key]

    def set_prefix_caching(self, on: bool) -> None:
        """Called on each EngineReady: whether every ready engine caches prefixes (AUTO)."""
        self._prefix_caching = on

    @property
    def prefix_caching(self) -> bool:
        """Whether every ready engine caches prefixes (as last reported)."""
        return self._prefix_caching

    @property
    def cache_aware(self) -> bool:
        """Whether `choose` looks for the engine holding the prompt's prefix."""
        policy = self.config.policy
        return policy == "cache-aware" or (policy == AUTO and self._prefix_caching)

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the picture is inconsistent: a negative
        count, a block held by no engine or by an unknown one, the LRU bound exceeded."""
        num_engines = len(self.loads)
        assert all(load.num_local >= 0 for load in self.loads), self.loads
        assert -1 <= self._last < num_engines, self._last
        assert len(self._blocks) <= MAX_TRACKED_BLOCKS
        for holders in self._blocks.values():
            assert holders and all(0 <= e < num_engines for e in holders), holders

    # ---- helpers -----------------------------------------------------------------------------

    def _keys(self, prompt_ids: Sequence[int]) -> list[bytes]:
        keys: list[bytes] = []
        num_full = len(prompt_ids) // ROUTER_BLOCK_LEN
        extend_block_keys(keys, prompt_ids, ROUTER_BLOCK_LEN, _NAMESPACE, num_full)
        return keys

    def _best_match(self, prompt_ids: Sequence[int], ready: Sequence[int]) -> Optional[int]:
        """The ready engine holding the longest run of the prompt's leading blocks."""
        matched = dict.fromkeys(ready, 0)
        alive = set(ready)
        for key in self._keys(prompt_ids):
            holders = self._blocks.get(key)
            alive &= holders if holders is not None else set()
            if not alive:
                break
            for engine in alive:
                matched[engine] += 1
        best = max(ready, key=lambda e: (matched[e], -self.loads[e].estimate()))
        return best if matched[best] >= self.config.min_match_blocks else None

    def _overloaded(self, engine: int, ready: Sequence[int]) -> bool:
        least = min(self.loads[e].estimate() for e in ready)
        load = self.loads[engine].estimate()
        cfg = self.config
        return load > least + cfg.balance_abs and load > least * cfg.balance_rel

    def _least_loaded(self, ready: Sequence[int]) -> int:
        least = min(self.loads[e].estimate() for e in ready)
        return self._next_after(self._last, [e for e in ready if self.loads[e].estimate() == least])

    def _next_after(self, last: int, candidates: Sequence[int]) -> int:
        """The first candidate after `last` in cyclic engine order."""
        n = len(self.loads)
        return min(candidates, key=lambda e: (e - last - 1) % n)
