"""Automatic prefix caching, the scheduler's side: which of a request's blocks can come from the
cache, and when its own full blocks become findable.

The cache itself lives in the block pool (services/scheduler/block_pool.py): registered blocks
keyed by content (shared/prefix_hash.py; kept as ints, see there why). This module decides what
is looked up and registered:

* lookup: when a request is scheduled for the first time, or resumes after preemption, its
  longest prefix of cached full blocks goes into its table and only the rest is computed. At most
  (len(tokens) - 1) // block_size blocks are looked up, so at least one token is always computed
  (the last position must produce logits) and a hit block is never written to.
* registration: a full block becomes findable only once the step that computed its last slot
  has completed. Two kinds are queued and registered off the result -> plan path, by `flush()`
  (the server calls `after_plan()` once the next plan has left):
  - blocks filled by prefill chunks: counted when the plan is built (step.py `BuiltStep.filled`)
    and queued by the result path (`queue_filled`) when the step's result arrives (a failed
    step's never are);
  - blocks filled by decodes: queued (`queue_grown`) when the request's table next grows.
  A lookup whose first miss a queued block may hold flushes first, so no lookup misses a
  completed block (and lookups that cannot hit, e.g. of prompts no one shares, flush nothing).
  A preempted or finishing request registers what it computed at once (`register_computed`:
  its blocks are freed next). A failed step registers nothing, and a worker failure or
  (re)handshake replaces the pool, which empties the cache.

Keys cost ~1-2 us per block, so they are computed off the result -> plan path where possible:
a prompt's at `add_request` (which the server runs while the worker computes), a decode-filled
block's in `flush()`. Same-run figures for both queues, on ÷ off: docs/design/scheduler.md.

Eviction ahead (`after_plan`): once the free stack runs short (a full cache), every block an
allocation takes must be evicted first (its key dropped, on the path). So after each plan the
free stack is topped up from the cache's least recently used end with as many blocks as the
most any of the last `EVICT_AHEAD_STEPS` steps took (at most what one step can allocate,
`max_step_blocks`), and the next step pops them. This bends one rule of the cache -- a released
block stays findable until it is reused -- for a bounded set: at any moment at most that many
blocks, the next ones to be evicted anyway, are dropped up to a step early. A lookup loses a
hit only on those (the oldest cached blocks); with free blocks to spare, nothing is evicted
ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import Request, RequestStatus
from services.scheduler.step import StepBuilder
from shared.prefix_hash import extend_int_block_keys

RUNNING = RequestStatus.RUNNING
# steps over which `after_plan` remembers how many blocks a step took (evicting ahead the most
# of them): two block periods of a decode, which crosses a block boundary every block_size steps
# (16 by default), so a batch of decodes crossing together is remembered until they cross again
EVICT_AHEAD_STEPS = 32

# a queued chunk: (request, its preemption count when the plan was built, the full blocks of
# its table once that step completed)
Filled = tuple[Request, int, int]


@dataclass(slots=True)
class PrefixCacheCounters:
    """Since start; tokens, as vLLM counts them: a query is a (re)scheduled request's tokens,
    a hit the part of them found cached."""

    num_queries: int = 0  # tokens looked up
    num_hits: int = 0  # tokens found cached
    num_resets: int = 0

    def as_stats(self) -> dict[str, float]:
        q = self.num_queries
        return {
            "prefix_cache_queries": q,
            "prefix_cache_hits": self.num_hits,
            "prefix_cache_hit_rate": self.num_hits / q if q else 0.0,
            "num_prefix_cache_resets": self.num_resets,
        }


class PrefixCache:
    """Lookups and registrations for one block pool. With `enabled` false every lookup misses
    and nothing is registered (the scheduler then skips calling it on its paths)."""

    def __init__(self, pool: BlockPool, namespace: bytes, enabled: bool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.namespace = namespace
        self.enabled = enabled
        self.counters = PrefixCacheCounters()
        self._filled: list[Filled] = []  # chunks of completed steps (`queue_filled`)
        # decoding requests whose full table grew by a block (`queue_grown`): the blocks before
        # the new one are registered by `flush()` (see `_grown_full`)
        self._grown: list[Request] = []
        # eviction ahead (`after_plan`): blocks each of the last steps took from the free stack
        # or by evicting, and the free stack's length and the eviction count when the last
        # `after_plan` ended
        self._step_demand: deque[int] = deque(maxlen=EVICT_AHEAD_STEPS)
        self._registered = pool.registered_keys()  # read only here (a lookup's first probe)
        self._free_left = pool.num_plain_free
        self._evicted_seen = pool.num_evicted

    # ---- queued registrations ----------------------------------------------------------------

    def queue_filled(self, filled: list[Filled]) -> None:
        """Called by the result path with a completed step's chunks (`InFlightStep.filled`):
        registered by `flush()`, off the path."""
        self._filled.extend(filled)

    def queue_grown(self, reqs: list[Request]) -> None:
        """Called by the step filler with the decodes whose table grew this step (one call a
        step): the blocks before each one's new block are registered by `flush()`."""
        self._grown.extend(reqs)

    def flush(self) -> None:
        """Register what was queued. A chunk of a request preempted or finished since was
        registered at that moment, and one no longer running holds other blocks now: both
        are skipped."""
        if self._filled:
            for req, num_preemptions, num_full in self._filled:
                if req.status is RUNNING and req.num_preemptions == num_preemptions:
                    self._register(req, min(num_full, len(req.block_ids)))
            self._filled.clear()
        if self._grown:
            bs = self.block_size
            for req in self._grown:
                self._register(req, _grown_full(req, bs))
            self._grown.clear()

    def after_plan(self, max_step_blocks: int) -> None:
        """Called once a plan has left, while the worker computes (the scheduler's
        `after_plan()`): `flush()`, then evict ahead (see the module docstring) so the free
        stack holds as many blocks as the most any of the last steps took, at most
        `max_step_blocks` (what one step can allocate). What a step took is measured here, not
        on the path: the free stack's shrinkage since the last call plus the blocks evicted on
        the path (an underestimate when blocks were freed meanwhile)."""
        pool = self.pool
        taken = max(0, self._free_left - pool.num_plain_free)
        self._step_demand.append(taken + pool.num_evicted - self._evicted_seen)
        self.flush()
        pool.evict_ahead(min(max(self._step_demand), max_step_blocks))
        self._free_left = pool.num_plain_free
        self._evicted_seen = pool.num_evicted

    def register_computed(self, req: Request) -> None:
        """Make `req`'s full blocks findable, up to what it computed. Called when it is
        preempted or finishes, before its blocks are freed (no later plan writes them)."""
        self._register(req, min(req.num_computed_tokens // self.block_size, len(req.block_ids)))

    def _register(self, req: Request, num_full: int) -> None:
        """Register `req`'s table's blocks [req.num_registered_blocks, num_full) under its keys."""
        if num_full <= req.num_registered_blocks:
            return
        keys = req.block_keys
        if len(keys) < num_full:
            extend_int_block_keys(keys, req.token_ids, self.block_size, self.namespace, num_full)
        self.pool.register_blocks(req.block_ids, keys, req.num_registered_blocks, num_full)
        req.num_registered_blocks = num_full

    # ---- lookups -----------------------------------------------------------------------------

    def prepare(self, req: Request) -> None:
        """A request arrived: compute the keys of its prompt's full blocks now (the server
        handles arrivals while the worker computes), so lookups and registrations of them on
        the result -> plan path are dictionary operations."""
        if self.enabled:
            self._keys(req)

    def _keys(self, req: Request) -> tuple[list[int], int]:
        """`req`'s keys, computed up to its last full block before the last token, and how many
        blocks that is (what a lookup may find)."""
        bs = self.block_size
        num_full = (len(req.token_ids) - 1) // bs
        keys = req.block_keys
        if len(keys) < num_full:
            extend_int_block_keys(keys, req.token_ids, bs, self.namespace, num_full)
        return keys, num_full

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks `req` could start with (changes nothing but, when a queued
        registration may extend the hit, flushes the queue). Computes the request's block keys
        once; later lookups (each schedule() while it waits) are dict reads. A mean-pooled
        embedding request finds nothing: its worker must compute every position."""
        if not self.enabled or req.sampling.pooling == "mean":
            return []
        keys, num_full = self._keys(req)
        if not num_full:
            return []
        # a prompt whose first block is not cached (no shared prefix) costs one dict read
        hits = self.pool.find_prefix(keys, num_full) if keys[0] in self._registered else []
        if len(hits) < num_full and self._may_be_queued(keys[len(hits)], len(hits)):
            self.flush()  # a completed block not registered yet would extend the hit
            hits = self.pool.find_prefix(keys, num_full)
        return hits

    def _may_be_queued(self, key: int, depth: int) -> bool:
        """Whether a queued registration may be the block `key` at table index `depth` (the
        first miss of a lookup): only then must the queue be flushed on the result -> plan path
        (with no shared prefix, never). True when unsure (keys of decode-filled blocks are
        computed by `flush()`)."""
        for req, _, num_full in self._filled:
            if req.num_registered_blocks <= depth < num_full and _may_be(req, depth, key):
                return True
        bs = self.block_size
        for req in self._grown:
            if req.num_registered_blocks <= depth < _grown_full(req, bs) and _may_be(
                req, depth, key
            ):
                return True
        return False

    def version(self) -> tuple[int, int]:
        """(cached blocks dropped, blocks registered) since start: while the first stays the
        same, every block found cached earlier is still cached (the `lpm` policy's memo)."""
        return (self.pool.num_dropped, self.pool.num_registrations)

    def cached_len(self, req: Request, known_len: int = 0) -> int:
        """Tokens of `req`'s prompt found cached now (the `lpm` policy's key); the first
        `known_len` are known to be (found earlier, nothing dropped since): only the blocks
        after them are looked up. Changes nothing but, like `lookup`, may flush the queue."""
        if not self.enabled:
            return 0
        keys, num_full = self._keys(req)
        depth = self.pool.num_prefix(keys, num_full, known_len // self.block_size)
        if depth < num_full and self._may_be_queued(keys[depth], depth):
            self.flush()
            depth = self.pool.num_prefix(keys, num_full, depth)
        return depth * self.block_size

    def registered_len(self, req: Request) -> int:
        """Tokens of `req`'s prompt registered now, by the keys it has (read-only: no key is
        computed, no queue flushed; for the lpm memo's check)."""
        num_full = (len(req.token_ids) - 1) // self.block_size
        return self.pool.num_prefix(req.block_keys, num_full) * self.block_size

    def attach(self, req: Request, hits: list[int], step: StepBuilder) -> None:
        """`req` (no blocks, nothing computed) starts with `hits` from `lookup()` in its table:
        they count as computed. Call before allocating its other blocks, so that allocation
        cannot evict them. Counts the query (a miss when `hits` is empty)."""
        if hits:  # a miss changes nothing but the counts
            self.pool.take_cached(hits)
            req.attach_cached(hits, self.block_size)
        self.count(req, step)

    def attach_if_room(self, req: Request, step: StepBuilder) -> bool:
        """`attach` its hits if there are any and reviving them leaves the pool non-negative
        (dynamic/static members restarting in place); False when it starts from nothing."""
        hits = self.lookup(req)
        if not hits or not self.pool.can_allocate(self.pool.num_reviving(hits), False):
            return False
        self.attach(req, hits, step)
        return True

    def count(self, req: Request, step: StepBuilder) -> None:
        """One lookup that led to scheduling `req`: counters, step log, and the request's
        `num_cached_tokens` when it is scheduled for the first time."""
        num_cached = req.num_computed_tokens
        if req.num_cached_tokens is None:  # a resumption's hit may reach past its prompt
            req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
        self.counters.num_queries += len(req.token_ids)
        self.counters.num_hits += num_cached
        step.num_cache_queries += len(req.token_ids)
        step.num_cache_hits += num_cached

    # ---- the rest ----------------------------------------------------------------------------

    def reset(self) -> int:
        """Empty the cache (the `reset_prefix_cache` command, and after a failed step with
        overlap); the number of keys dropped. Queued registrations are dropped too."""
        self.counters.num_resets += 1
        self._filled.clear()
        self._grown.clear()
        return self.pool.reset_cache()

    def stats(self) -> dict[str, float]:
        out = self.counters.as_stats()
        out["prefix_cache_blocks"] = self.pool.num_cached
        out["num_prefix_cache_evictions"] = self.pool.num_evicted
        return out

    def check_invariants(self, running: Iterable[Request]) -> None:
        """Raise AssertionError unless each running table's registered blocks hold the content
        its request's keys claim (no request reads another prefix's KV), and no more are
        registered than it computed. Read-only."""
        bs = self.block_size
        for req in running:
            assert req.num_registered_blocks * bs <= req.num_computed_tokens, req.rid
            for i in range(req.num_registered_blocks):
                key = self.pool.key_of(req.block_ids[i])
                assert key in (None, req.block_keys[i]), f"{req.rid}: block {i} holds other KV"


def _may_be(req: Request, depth: int, key: int) -> bool:
    """Whether `req`'s block at `depth` may have content `key` (unknown keys: maybe)."""
    keys = req.block_keys
    return depth >= len(keys) or keys[depth] == key


def _grown_full(req: Request, block_size: int) -> int:
    """How many blocks of a `grown` request's table its completed steps filled: all but the
    new one, while it decodes. 0 (nothing to register) once it was preempted since: then its
    blocks were registered at that moment, and a request readmitted since is in prefill (the
    blocks of a chunk in flight wait for its result); the same request decoding again after a
    readmission (a queue not flushed since) has computed everything but its new last block."""
    computed = req.num_computed_tokens
    if req.status is not RUNNING or computed <= req.prefill_len:
        return 0
    return min(computed // block_size, len(req.block_ids) - 1)
