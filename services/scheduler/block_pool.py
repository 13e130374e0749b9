"""The KV block pool: a free list and reference counts over the worker's `num_blocks` blocks.

The scheduler owns every block table; the worker only stores KV where a plan tells it to.
Reference counts are kept per block so that prefix sharing can later hand one block to several
tables; today each allocated block has exactly one owner. All operations are O(blocks touched);
nothing walks the whole pool except `check_integrity()`, which tests call after every step.
"""

from __future__ import annotations

from collections.abc import Iterable
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_have: int, num_tokens: int) -> int:
        """Blocks to add to a table of `num_have` blocks so it covers `num_tokens` positions."""
        return max(0, -(-num_tokens // self.block_size) - num_have)

    def can_allocate(self, num: int, keep_watermark: bool) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return len(self._free) - num >= reserve

    def allocate(self, num: int) -> Optional[list[int]]:
        """Take `num` free blocks (ref count 1 each), or None (and take nothing) if too few."""
        if num > len(self._free):
            return None
        if num == 1:  # the common case: one decode crossed a block boundary
            block = self._free.pop()
            self._ref_counts[block] = 1
            return [block]
        taken = self._free[len(self._free) - num :]
        del self._free[len(self._free) - num :]
        taken.reverse()
        for block in taken:
            self._ref_counts[block] = 1
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block with no reference left becomes free.

        Freed in reverse so the table's first block is reused first (a stack).
        """
        refs = self._ref_counts
        for block in reversed(list(block_ids)):
            if refs[block] <= 0:
                raise ValueError(f"block {block} freed but not allocated")
            refs[block] -= 1
            if refs[block] == 0:
                self._free.append(block)

    def check_integrity(self, tables: Iterable[list[int]], shared_ok: bool = False) -> None:
        """Raise AssertionError unless free + used == total, the free list holds each free block
        once, every owned block's ref count equals its number of owners, and (unless `shared_ok`)
        no block is owned twice. O(num_blocks): for tests and debugging only."""
        owners = [0] * self.num_blocks
        for table in tables:
            for block in table:
                if not 0 <= block < self.num_blocks:
                    raise AssertionError(f"block id {block} outside the pool")
                owners[block] += 1
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        num_owned = sum(1 for n in owners if n > 0)
        if num_owned + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"free {len(self._free)} + used {num_owned} != total {self.num_blocks}"
            )
        for block, n in enumerate(owners):
            if n > 1 and not shared_ok:
                raise AssertionError(f"block {block} is owned by {n} tables")
            if n != self._ref_counts[block]:
                raise AssertionError(f"block {block}: ref count {self._ref_counts[block]} != {n}")
            if (n == 0) != (block in free_set):
                raise AssertionError(f"block {block} is both free and owned, or neither")
