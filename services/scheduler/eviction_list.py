"""The prefix cache's eviction list: the cached blocks (ref count 0, registered) in the order
they were released, least recently released first, with O(1) append, removal and pop of the
oldest. The block pool (services/scheduler/block_pool.py) evicts from its front.

It replaced an `OrderedDict`, which does the same in C but whose every operation probes a hash
table of tens of thousands of entries and allocates or frees a linked-list node. With a full
cache the scheduler releases and evicts dozens of blocks a step, off the result -> plan path
(`after_plan()`), and those scattered writes slowed the path's next step through the CPU's
caches (docs/PERFORMANCE.md §9, sixth round). Here a release appends the block to a deque and
sets its byte in a flag array; an eviction pops the deque's other end.

Removal (a cache hit takes a cached block back) is lazy: the block's flag is cleared and its
entry stays in the deque, to be skipped when it reaches the front. A block released again gets
a new entry at the back, so a block may have several entries: only its last one counts (its
per-block entry count reaches zero there). When stale entries outnumber the live ones (plus a
constant), the deque is rebuilt from the live entries: O(entries), so O(1) amortized per
operation, and the deque never holds more than about twice the listed blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

# stale entries tolerated beyond the listed blocks before the deque is rebuilt (so that a small
# list with blocks taken and released over and over is not rebuilt on every release)
COMPACT_SLACK = 64


class EvictionList:
    """An ordered set of block ids in [0, num_blocks): release order, oldest first."""

    def __init__(self, num_blocks: int) -> None:
        self._order: deque[int] = deque()  # entries, oldest first; stale ones included
        self._num_entries = [0] * num_blocks  # per block: its entries in `_order`
        self._listed = bytearray(num_blocks)  # per block: 1 while it is on the list
        # blocks listed: read by the pool on its paths (an attribute, cheaper than len());
        # changed only here
        self.num_listed = 0

    def __len__(self) -> int:
        return self.num_listed

    @property
    def num_entries(self) -> int:
        """Entries in the deque, stale ones included (at most ~2 x listed + COMPACT_SLACK)."""
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return self._listed[block] == 1

    def extend(self, blocks: Iterable[int]) -> None:
        """`blocks` (none listed) become the most recently released, the last the newest."""
        listed, entries, order = self._listed, self._num_entries, self._order
        num = 0
        for block in blocks:
            listed[block] = 1
            order.append(block)
            entries[block] += 1
            num += 1
        self.num_listed += num
        if len(order) > 2 * self.num_listed + COMPACT_SLACK:
            self._compact()

    def discard(self, block: int) -> bool:
        """Take `block` off the list if it is listed (its entry goes stale); whether it was."""
        if not self._listed[block]:
            return False
        self._listed[block] = 0
        self.num_listed -= 1
        return True

    def pop_oldest(self, num: int) -> list[int]:
        """Take the `num` least recently released blocks off the list (num <= len)."""
        if num > self.num_listed:
            raise ValueError(f"{num} blocks asked of an eviction list of {self.num_listed}")
        pop, entries, listed = self._order.popleft, self._num_entries, self._listed
        blocks: list[int] = []
        while len(blocks) < num:
            block = pop()
            left = entries[block] - 1
            entries[block] = left
            if left == 0 and listed[block]:  # its last entry: live
                listed[block] = 0
                blocks.append(block)
        self.num_listed -= num
        return blocks

    def drain(self) -> list[int]:
        """Every listed block, oldest first; the list is left empty (no stale entries either)."""
        live = self._live()  # every entry count is 0 now
        for block in live:
            self._listed[block] = 0
        self._order.clear()
        self.num_listed = 0
        return live

    def blocks(self) -> set[int]:
        """The listed blocks (O(num_blocks): for integrity checks)."""
        return {block for block, flag in enumerate(self._listed) if flag}

    def check_integrity(self) -> None:
        """Raise AssertionError unless the counts agree with the deque: each block's entry count
        is its number of entries, every listed block has one, and the length is right."""
        counts = [0] * len(self._num_entries)
        for block in self._order:
            counts[block] += 1
        if counts != self._num_entries:
            raise AssertionError("eviction list: entry counts disagree with its deque")
        listed = self.blocks()
        if len(listed) != self.num_listed:
            raise AssertionError(
                f"eviction list: {len(listed)} blocks listed, {self.num_listed} counted"
            )
        for block in listed:
            if counts[block] == 0:
                raise AssertionError(f"eviction list: listed block {block} has no entry")

    def _compact(self) -> None:
        """Rebuild the deque from the live entries, in order."""
        live = self._live()
        for block in live:
            self._num_entries[block] = 1
        self._order = deque(live)

    def _live(self) -> list[int]:
        """The listed blocks in order (each one's last entry); every entry count drops to 0."""
        entries, listed = self._num_entries, self._listed
        live: list[int] = []
        for block in self._order:
            left = entries[block] - 1
            entries[block] = left
            if left == 0 and listed[block]:
                live.append(block)
        return live
