"""The KV block pool: reference counts, free blocks and the prefix cache over `num_blocks` blocks.

The scheduler owns every block table; the worker only stores KV where a plan tells it to.
A block is in exactly one of three states:

* owned: ref count >= 1, in that many tables (several when a cached prefix is shared);
* free: ref count 0, holds nothing findable, on the free stack;
* cached: ref count 0 but registered under its content key (shared/prefix_hash.py), findable
  by `find_prefix` until it is evicted; kept in release order, least recently released first
  (an `OrderedDict` used as an ordered set: O(1) append, removal and pop of the oldest).

An owned block may be registered too (it is findable while in use). Allocation takes free
blocks first, then evicts the least recently released cached block (its key is dropped).
`evict_ahead()` does that eviction early, off the result -> plan path: a bounded number of the
next blocks to evict go to the free stack (unregistered) before they are needed. A table's
blocks are released deepest first, so among blocks released together the deepest is evicted
first and a prefix's shared root lives longest. All operations are O(blocks touched); only
`check_invariants()` walks the pool (tests call it after every step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Optional


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs num_blocks >= 1 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Admissions keep this many blocks free so running decodes can grow before preempting.
        self.watermark_blocks = int(num_blocks * watermark)
        # A stack: the lowest ids come out first, which keeps test output readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks
        self._key_of: list[Optional[int]] = [None] * num_blocks  # registered content key
        # content key -> the block registered under it (one dict for the pool's life: cleared,
        # never replaced, since `registered_keys()` hands it out)
        self._by_key: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.num_evicted = 0  # cached blocks reused for something else, since start
        # since start: registered keys dropped (evictions and resets), and registrations; a
        # caller that found a prefix cached knows it still is while num_dropped stays the same
        self.num_dropped = 0
        self.num_registrations = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free plus cached (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_plain_free(self) -> int:
        """Blocks on the free stack: never registered, or evicted already (`evict_ahead`)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks, owned or not: what `find_prefix` can return."""
        return len(self._by_key)

    def blocks_needed(self, num_have: int, num_tokens: int) -> int:
        """Blocks to add to a table of `num_have` blocks so it covers `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - num_have)

    def can_allocate(self, num: int, keep_watermark: bool) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_free - num >= reserve

    def allocate(self, num: int) -> Optional[list[int]]:
        """Take `num` blocks (ref count 1 each), or None (and take nothing) if too few.
        Free blocks go first; then cached blocks are evicted, oldest first."""
        free = self._free
        if num == 1:  # the common case: one decode crossed a block boundary
            if free:
                block = free.pop()
            elif self._cached:
                block = self._evict_oldest(1)[0]
            else:
                return None
            self._ref_counts[block] = 1
            return [block]
        if num > len(free) + len(self._cached):
            return None
        num_plain = min(num, len(free))
        taken = free[len(free) - num_plain :]
        del free[len(free) - num_plain :]
        taken.reverse()
        if num > num_plain:
            taken.extend(self._evict_oldest(num - num_plain))
        refs = self._ref_counts
        for block in taken:
            refs[block] = 1
        return taken

    def _evict_oldest(self, num: int) -> list[int]:
        """Unregister the `num` least recently released cached blocks and return them."""
        key_of, by_key, pop = self._key_of, self._by_key, self._cached.popitem
        blocks = [pop(last=False)[0] for _ in range(num)]
        for block in blocks:
            del by_key[key_of[block]]  # type: ignore[index]  # cached blocks have keys
            key_of[block] = None
        self.num_evicted += num
        self.num_dropped += num
        return blocks

    def evict_ahead(self, num: int) -> int:
        """Evict the least recently released cached blocks onto the free stack until it holds
        `num` blocks (or nothing is cached); returns how many moved. Called off the result ->
        plan path (PrefixCache.after_plan), so that the next step's allocations pop the free
        stack instead of evicting on the path. They go under the plain free blocks, the oldest
        highest: allocations take the same blocks in the same order as without this call; the
        only difference is that the moved blocks stop being findable before they are reused."""
        num_moved = min(num - len(self._free), len(self._cached))
        if num_moved <= 0:
            return 0
        blocks = self._evict_oldest(num_moved)
        blocks.reverse()
        self._free[:0] = blocks  # popped after the plain free blocks, oldest first
        return num_moved

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these owned blocks (a KV hand-over's lease:
        services/scheduler/handover.py)."""
        refs = self._ref_counts
        for block in block_ids:
            if refs[block] <= 0:
                raise ValueError(f"block {block} shared but not owned")
            refs[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block with no reference left becomes cached
        (registered) or free. Released in reverse, deepest first: of blocks released together
        the deepest is evicted first, and the table's first plain block is reused first."""
        refs, key_of, free, cached = self._ref_counts, self._key_of, self._free, self._cached
        for block in reversed(block_ids):
            n = refs[block]
            if n == 1:  # the common case: its only owner
                refs[block] = 0
                if key_of[block] is None:
                    free.append(block)
                else:
                    cached[block] = None
            elif n > 1:
                refs[block] = n - 1
            else:
                raise ValueError(f"block {block} freed but not allocated")

    # ---- the prefix cache --------------------------------------------------------------------

    def find_prefix(self, keys: Sequence[int], num_max: int) -> list[int]:
        """The blocks registered under keys[0], keys[1], ... up to the first miss, at most
        `num_max`. Changes nothing: call `take_cached` once the caller will use them."""
        found: list[int] = []
        by_key = self._by_key
        for i in range(min(num_max, len(keys))):
            block = by_key.get(keys[i])
            if block is None:
                break
            found.append(block)
        return found

    def num_prefix(self, keys: Sequence[int], num_max: int, start: int = 0) -> int:
        """len(find_prefix(keys, num_max)), given that keys[:start] are registered: only the
        keys from `start` on are looked up."""
        by_key = self._by_key
        end = min(num_max, len(keys))
        i = min(start, end)
        while i < end and keys[i] in by_key:
            i += 1
        return i

    def registered_keys(self) -> Mapping[int, int]:
        """content key -> registered block, live (the same mapping for the pool's life): for
        a caller's first probe of a lookup (`key in registered_keys()`), without a call."""
        return self._by_key

    def num_reviving(self, block_ids: Iterable[int]) -> int:
        """How many of these registered blocks are cached (ref count 0): taking them uses up
        that many of `num_free`."""
        refs = self._ref_counts
        return sum(1 for b in block_ids if refs[b] == 0)

    def take_cached(self, block_ids: Iterable[int]) -> None:
        """A hit: one more reference to each (registered) block; cached ones leave the cache's
        release order."""
        refs, cached = self._ref_counts, self._cached
        for block in block_ids:
            if refs[block] == 0:
                del cached[block]
            refs[block] += 1

    def register_blocks(self, block_ids: Sequence[int], keys: Sequence[int], start: int,
                        end: int) -> int:  # fmt: skip
        """Called once the steps that filled owned blocks block_ids[start:end] completed: each
        becomes findable under its key in `keys`. A block registered already, or a key another
        block holds (two requests computed the same prefix in one step), is skipped. Returns
        how many were registered."""
        key_of, by_key, refs = self._key_of, self._by_key, self._ref_counts
        num = 0
        for i in range(start, end):
            block, key = block_ids[i], keys[i]
            if key_of[block] is not None or key in by_key:
                continue
            if refs[block] <= 0:
                raise ValueError(f"block {block} registered but not owned")
            key_of[block] = key
            by_key[key] = block
            num += 1
        self.num_registrations += num
        return num

    def key_of(self, block: int) -> Optional[int]:
        return self._key_of[block]

    def reset_cache(self) -> int:
        """Forget every registered key (owned blocks stay owned but are no longer findable);
        cached blocks become free. Returns the number of keys dropped."""
        dropped = len(self._by_key)
        self.num_dropped += dropped
        for block in self._by_key.values():
            self._key_of[block] = None
        self._by_key.clear()
        self._free.extend(self._cached)
        self._cached.clear()
        return dropped

    def check_invariants(self, tables: Iterable[list[int]], shared_ok: bool = False) -> None:
        """Raise AssertionError unless every block is in exactly one state (owned, free,
        cached), ref counts equal owners, the free stack and the cache's order hold each of
        their blocks once, the key maps are inverse, and (unless `shared_ok`) no block is owned
        twice. Read-only; O(num_blocks): for tests."""
        owners = [0] * self.num_blocks
        for table in tables:
            for block in table:
                if not 0 <= block < self.num_blocks:
                    raise AssertionError(f"block id {block} outside the pool")
                owners[block] += 1
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free_set & self._cached.keys():
            raise AssertionError("a block is both free and cached")
        num_owned = sum(1 for n in owners if n > 0)
        if num_owned + self.num_free != self.num_blocks:
            raise AssertionError(
                f"free {self.num_free} + used {num_owned} != total {self.num_blocks}"
            )
        for key, block in self._by_key.items():
            if self._key_of[block] != key:
                raise AssertionError(f"block {block}: key maps disagree")
        for block, n in enumerate(owners):
            self._check_block(block, n, shared_ok, block in free_set)

    def _check_block(self, block: int, num_owners: int, shared_ok: bool, is_free: bool) -> None:
        if num_owners > 1 and not shared_ok:
            raise AssertionError(f"block {block} is owned by {num_owners} tables")
        if num_owners != self._ref_counts[block]:
            raise AssertionError(
                f"block {block}: ref count {self._ref_counts[block]} != {num_owners}"
            )
        key = self._key_of[block]
        if key is not None and self._by_key.get(key) != block:
            raise AssertionError(f"block {block}: key maps disagree")
        is_cached = block in self._cached
        if (num_owners == 0) != (is_free or is_cached):
            raise AssertionError(f"block {block} is both unowned and owned, or neither")
        if is_cached and key is None:
            raise AssertionError(f"block {block} is cached but has no key")
        if is_free and key is not None:
            raise AssertionError(f"block {block} is free but still has a key")
