"""The KV block pool: free blocks, reference counts and the prefix cache over `num_blocks` blocks.

The scheduler owns every block table; the worker only stores KV where a plan tells it to.
A block is in exactly one of four states:

* owned: ref count >= 1, in that many tables (several when a cached prefix is shared);
* free: ref count 0, holds nothing findable, on the free stack;
* cached: ref count 0 but holds a full block registered under its content key (see
  shared/prefix_hash.py); findable by `find_prefix` until it is evicted, on the eviction list;
* held: ref count 0, released by `hold()` (a finishing request's table, on the result -> plan
  path) but not yet free or cached: its registration waits for `release_held()` (the scheduler's
  `after_plan()`, off that path), which then moves it to the free stack or the eviction list, in
  the order `free()` would have. It counts as free; registered held blocks stay findable (a
  hit takes them back).

An owned block may be registered too (it is findable while in use). Allocation takes free
blocks first, then evicts the least recently released cached block, and only then releases the
held blocks (the most recently released; their pending registrations are dropped).
`evict_ahead()` does the eviction part early, off the result -> plan path: a bounded number of
the next blocks to evict go to the free stack (unregistered) before they are needed. A table's
blocks are released deepest first, so among blocks released together the deepest is evicted
first and a prefix's shared root lives longest. All operations are O(blocks touched); only
`check_integrity()` walks the pool (tests call it after every step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Optional

from services.scheduler.eviction_list import EvictionList


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
        # cached blocks (ref count 0, registered), least recently released first (an ordered
        # set with O(1) append, removal and pop of the oldest; see there why not an OrderedDict)
        self._evictable = EvictionList(num_blocks)
        # held blocks (ref count 0, registration pending): per block, the `hold()` that
        # released it (None: not held), and each hold's table with its id, in hold order (a
        # table's blocks held in reverse: the release order). A list store per block, not a
        # dict of held blocks: `hold()` runs on the result -> plan path, and its per-block work
        # is what freeing the table would cost. A block that left that state since (taken by a
        # hit, released) is not registered by that hold's registration, even if another hold
        # holds it again.
        self._held_by: list[Optional[int]] = [None] * num_blocks
        self._held_tables: list[tuple[list[int], int]] = []
        self._num_held = 0
        self._num_holds = 0
        self.num_evicted = 0  # cached blocks reused for something else, since start
        # since start: registered keys dropped (evictions and resets), and registrations; a
        # caller that found a prefix cached knows it still is while num_dropped stays the same
        self.num_dropped = 0
        self.num_registrations = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free plus cached (evicted on demand) plus held."""
        return len(self._free) + self._evictable.num_listed + self._num_held

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_held(self) -> int:
        return self._num_held

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

        Never-registered free blocks go first; then cached blocks are evicted, oldest first;
        held blocks (the newest releases) only when those do not suffice.
        """
        free = self._free
        if num > len(free) + self._evictable.num_listed:
            if num > len(free) + self._evictable.num_listed + self._num_held:
                return None
            self.release_held()  # their registrations are dropped: the blocks are needed
        if num == 1:  # the common case: one decode crossed a block boundary
            if free:
                block = free.pop()
            else:  # a full cache and nothing evicted ahead
                block = self._evict_oldest(1)[0]
            self._ref_counts[block] = 1
            return [block]
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
        key_of, by_key = self._key_of, self._by_key
        blocks = self._evictable.pop_oldest(num)
        for block in blocks:
            del by_key[key_of[block]]  # type: ignore[index]  # evictable blocks have keys
            key_of[block] = None
        self.num_evicted += num
        self.num_dropped += num
        return blocks

    def evict_ahead(self, num: int) -> int:
        """Evict the least recently released cached blocks onto the free stack until it holds
        `num` blocks (or nothing is cached); returns how many moved. Called off the result ->
        plan path (the scheduler's `after_plan()`), so that the next step's allocations pop
        the free stack instead of evicting on the path. They go under the plain free blocks,
        the oldest highest: allocations take the same blocks in the same order as without
        this call; the only difference is that the moved blocks stop being findable before
        they are reused (see prefix_cache.py). O(num): it moves blocks only while the free
        stack holds fewer than `num`."""
        num_moved = min(num - len(self._free), self._evictable.num_listed)
        if num_moved <= 0:
            return 0
        blocks = self._evict_oldest(num_moved)
        blocks.reverse()
        self._free[:0] = blocks  # popped after the plain free blocks, oldest first
        return num_moved

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block with no reference left becomes cached
        (registered) or free. Released in reverse, deepest first: of blocks released together
        the deepest is evicted first, and the table's first plain block is reused first."""
        refs, key_of, free = self._ref_counts, self._key_of, self._free
        cached: list[int] = []
        for block in reversed(block_ids):
            n = refs[block]
            if n == 1:  # the common case: its only owner
                refs[block] = 0
                if key_of[block] is None:
                    free.append(block)
                else:
                    cached.append(block)
            elif n > 1:
                refs[block] = n - 1
            else:
                raise ValueError(f"block {block} freed but not allocated")
        if cached:
            self._evictable.extend(cached)

    def hold(self, table: list[int]) -> int:
        """`free()` for a finishing table whose registration waits for `after_plan()`: a block
        with no reference left becomes held (registered or not) instead of free or cached.
        `table` is the pool's from now on (the caller keeps no other use of it). Returns the
        hold's id for `register_held()`; `release_held()` ends the state."""
        refs, held_by = self._ref_counts, self._held_by
        self._num_holds += 1
        hold_id = self._num_holds
        num_held = 0
        for block in table:  # released in reverse by release_held()
            n = refs[block]
            if n == 1:
                refs[block] = 0
                held_by[block] = hold_id
                num_held += 1
            elif n > 1:
                refs[block] = n - 1
            else:
                raise ValueError(f"block {block} freed but not allocated")
        self._num_held += num_held
        self._held_tables.append((table, hold_id))
        return hold_id

    def release_held(self) -> None:
        """Held blocks become cached (registered) or free, in the order `free()` would have
        released them (hold by hold, each table in reverse). Called after their registrations
        (`register_held`), off the result -> plan path, or by an allocation that needs them
        (their registrations are dropped)."""
        if not self._held_tables:
            return
        free, key_of, held_by = self._free, self._key_of, self._held_by
        cached: list[int] = []
        for table, hold_id in self._held_tables:
            for block in reversed(table):
                if held_by[block] == hold_id:
                    held_by[block] = None
                    if key_of[block] is None:
                        free.append(block)
                    else:
                        cached.append(block)
        self._evictable.extend(cached)
        self._held_tables.clear()
        self._num_held = 0

    # ---- the prefix cache ----------------------------------------------------------------------

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
        """A hit: one more reference to each (registered) block; cached ones leave the
        eviction list."""
        refs, evictable = self._ref_counts, self._evictable
        for block in block_ids:
            if refs[block] == 0:
                if not evictable.discard(block):  # registered, released by a finishing table
                    self._held_by[block] = None
                    self._num_held -= 1
            refs[block] += 1

    def register(self, block: int, key: int) -> bool:
        """Called once the step that filled owned `block` completed: it becomes findable under
        `key`. False (and nothing changes) when another block already holds that content (two
        requests computed the same prefix in one step) or this one is registered already."""
        if self._key_of[block] is not None or key in self._by_key:
            return False
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} registered but not owned")
        self._key_of[block] = key
        self._by_key[key] = block
        self.num_registrations += 1
        return True

    def register_blocks(self, block_ids: Sequence[int], keys: Sequence[int], start: int,
                        end: int) -> None:  # fmt: skip
        """`register(block_ids[i], keys[i])` for i in [start, end), in one loop (the same rules:
        a block or key registered already is skipped)."""
        key_of, by_key, refs = self._key_of, self._by_key, self._ref_counts
        for i in range(start, end):
            block, key = block_ids[i], keys[i]
            if key_of[block] is not None or key in by_key:
                continue
            if refs[block] <= 0:
                raise ValueError(f"block {block} registered but not owned")
            key_of[block] = key
            by_key[key] = block
            self.num_registrations += 1

    def register_held(self, block_ids: Sequence[int], keys: Sequence[int], start: int,
                      end: int, hold_id: int) -> None:  # fmt: skip
        """`register_blocks` for a table given to `hold()` (which returned `hold_id`): only its
        blocks still held by that hold are registered (a block taken or released since may hold
        other KV now)."""
        key_of, by_key, held_by = self._key_of, self._by_key, self._held_by
        for i in range(start, end):
            block, key = block_ids[i], keys[i]
            if held_by[block] != hold_id or key_of[block] is not None or key in by_key:
                continue
            key_of[block] = key
            by_key[key] = block
            self.num_registrations += 1

    def key_of(self, block: int) -> Optional[int]:
        return self._key_of[block]

    def held_by(self, block: int) -> Optional[int]:
        """The `hold()` id that holds `block`, None unless it is held."""
        return self._held_by[block]

    def reset_cache(self) -> int:
        """Forget every registered key (owned blocks stay owned but are no longer findable);
        cached blocks become free. Returns the number of keys dropped."""
        dropped = len(self._by_key)
        self.num_dropped += dropped
        self.release_held()  # their pending registrations are dropped too
        for block in self._by_key.values():
            self._key_of[block] = None
        self._by_key.clear()
        self._free.extend(self._evictable.drain())
        return dropped

    def check_integrity(self, tables: Iterable[list[int]], shared_ok: bool = False) -> None:
        """Raise AssertionError unless every block is in exactly one state (owned, free,
        cached, held), each state's bookkeeping agrees (ref counts equal owners, the free stack,
        the eviction list and the held set hold each of their blocks once, the held count is
        right and each held block is in the table of the hold that holds it, key maps are
        inverse), and (unless `shared_ok`) no block is owned twice. O(num_blocks): for tests
        and debugging only."""
        owners = [0] * self.num_blocks
        for table in tables:
            for block in table:
                if not 0 <= block < self.num_blocks:
                    raise AssertionError(f"block id {block} outside the pool")
                owners[block] += 1
        self._evictable.check_integrity()
        free_set = set(self._free)
        cached = self._evictable.blocks()
        held = {b: h for b, h in enumerate(self._held_by) if h is not None}
        if len(held) != self._num_held:
            raise AssertionError(f"{len(held)} blocks held, {self._num_held} counted")
        held_tables = {hold_id: set(table) for table, hold_id in self._held_tables}
        for block, hold_id in held.items():
            if block not in held_tables.get(hold_id, ()):
                raise AssertionError(f"held block {block} is not in its hold's table")
        if len(free_set) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free_set & cached:
            raise AssertionError("a block is both free and cached")
        if held.keys() & (free_set | cached):
            raise AssertionError("a block is both held and free or cached")
        num_owned = sum(1 for n in owners if n > 0)
        if num_owned + self.num_free != self.num_blocks:
            raise AssertionError(
                f"free {self.num_free} + used {num_owned} != total {self.num_blocks}"
            )
        for key, block in self._by_key.items():
            if self._key_of[block] != key:
                raise AssertionError(f"block {block}: key maps disagree")
        for block, n in enumerate(owners):
            if n > 1 and not shared_ok:
                raise AssertionError(f"block {block} is owned by {n} tables")
            if n != self._ref_counts[block]:
                raise AssertionError(f"block {block}: ref count {self._ref_counts[block]} != {n}")
            key = self._key_of[block]
            if key is not None and self._by_key.get(key) != block:
                raise AssertionError(f"block {block}: key maps disagree")
            unowned = block in free_set or block in cached or block in held
            if (n == 0) != unowned:
                raise AssertionError(f"block {block} is both unowned and owned, or neither")
            if block in cached and key is None:
                raise AssertionError(f"block {block} is cached but has no key")
            if block in free_set and key is not None:
                raise AssertionError(f"block {block} is free but still has a key")
