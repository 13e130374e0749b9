"""The prefix cache's eviction list (services/scheduler/eviction_list.py) against its reference,
an `OrderedDict` used as an ordered set (what the block pool kept before), ~2 s.

Random streams of releases, removals, pops of the oldest and drains, over few blocks so that
blocks are taken and released again and again (stale entries pile up and the deque is
compacted): after every operation both hold the same blocks in the same order, and the list's
own integrity check passes.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.eviction_list import COMPACT_SLACK, EvictionList

NUM_BLOCKS = 12
OPS = ["append"] * 4 + ["remove"] * 3 + ["pop"] * 2 + ["extend", "drain"]
ops_lists = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, NUM_BLOCKS - 1), st.integers(1, 4)),
    min_size=1,
    max_size=300,
)


def _apply(op: str, block: int, num: int, lst: EvictionList, ref: OrderedDict[int, None]) -> None:
    """One operation on both, where it is legal (releases of unlisted blocks, pops of at most
    what is listed; a removal of a block not listed changes nothing and says so)."""
    if op == "append" and block not in ref:
        lst.extend([block])
        ref[block] = None
    elif op == "extend":
        blocks = [b for b in range(block, block + num) if b < NUM_BLOCKS and b not in ref]
        lst.extend(blocks)
        ref.update((b, None) for b in blocks)
    elif op == "remove":
        assert lst.discard(block) == (block in ref)
        ref.pop(block, None)
    elif op == "pop":
        num = min(num, len(ref))
        expected = [ref.popitem(last=False)[0] for _ in range(num)]
        assert lst.pop_oldest(num) == expected
    elif op == "drain":
        assert lst.drain() == list(ref)
        ref.clear()


@settings(max_examples=300, deadline=None)
@given(ops_lists)
def test_matches_an_ordered_dict(ops: list[tuple[str, int, int]]) -> None:
    lst, ref = EvictionList(NUM_BLOCKS), OrderedDict()
    for op, block, num in ops:
        _apply(op, block, num, lst, ref)
        lst.check_integrity()
        assert len(lst) == lst.num_listed == len(ref)
        assert lst.blocks() == set(ref)
        assert all((b in lst) == (b in ref) for b in range(NUM_BLOCKS))
    assert lst.drain() == list(ref)


def test_a_block_taken_and_released_again_moves_to_the_back() -> None:
    lst = EvictionList(4)
    lst.extend([0, 1, 2])
    lst.discard(0)  # a cache hit takes block 0 back ...
    lst.extend([0])  # ... and releases it again: now the most recent
    assert lst.pop_oldest(2) == [1, 2]
    assert lst.drain() == [0]


def test_stale_entries_stay_bounded() -> None:
    """One block taken and released over and over: the deque is compacted instead of growing
    by one entry each time."""
    lst = EvictionList(2)
    lst.extend([1, 0])
    for _ in range(10 * COMPACT_SLACK):
        lst.discard(0)
        lst.extend([0])
        assert lst.num_entries <= 2 * lst.num_listed + COMPACT_SLACK
    lst.check_integrity()
    assert lst.drain() == [1, 0]


def test_misuse_is_refused() -> None:
    lst = EvictionList(3)
    lst.extend([1])
    assert not lst.discard(2)  # not listed: nothing changes
    assert lst.blocks() == {1}
    with pytest.raises(ValueError, match="2 blocks asked"):
        lst.pop_oldest(2)
