"""The prefix cache's block pool alone (services/scheduler/block_pool.py, ~3 s): random streams
of every operation the scheduler uses, with `check_invariants()` after each (each block owned,
free or cached; ref counts equal owners; key maps inverse), and pictures of the eviction order
(free blocks first, then the least recently released cached one, the deepest of a table first).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_pool import BlockPool
from shared.prefix_hash import block_key, extend_block_keys, extend_int_block_keys


def _key(token_ids: list[int], namespace: bytes) -> int:
    """A first block's content key, as the scheduler's pool keeps it (an int)."""
    return int.from_bytes(block_key(None, token_ids, namespace), "little")


def test_int_keys_are_the_digests_of_the_shared_keys() -> None:
    """The scheduler's int keys are the shared key function's digests (the router's form)."""
    tokens = list(range(100, 150))
    as_bytes: list[bytes] = []
    as_ints: list[int] = []
    extend_block_keys(as_bytes, tokens, 16, b"ns", 2)
    extend_int_block_keys(as_ints, tokens, 16, b"ns", 2)
    extend_int_block_keys(as_ints, tokens, 16, b"ns", 3)  # continues from an int parent
    extend_block_keys(as_bytes, tokens, 16, b"ns", 3)
    assert as_ints == [int.from_bytes(k, "little") for k in as_bytes]


# ---- the pool alone --------------------------------------------------------------------------

POOL_OPS = ["alloc", "free", "register", "hit", "reset"]
pool_ops = st.lists(st.tuples(st.sampled_from(POOL_OPS), st.integers(0, 99)), max_size=60)


def _register_one(pool: BlockPool, block: int, key: int) -> bool:
    """Register one block; whether it was (not when it or the key is registered already)."""
    return pool.register_blocks([block], [key], 0, 1) == 1


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=pool_ops)
def test_pool_states_stay_consistent_under_random_operations(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    """Tables as lists of blocks; every operation the scheduler uses, in any order."""
    pool = BlockPool(num_blocks, block_size=2)
    tables: list[list[int]] = []
    content: dict[int, int] = {}  # block -> the key it was registered under (while it is)
    for op, x in ops:
        if op == "alloc":
            got = pool.allocate(1 + x % 3)
            if got is not None:
                assert all(pool.key_of(b) is None for b in got)  # evicted: no key any more
                tables.append(got)
        elif op == "free" and tables:
            pool.free(tables.pop(x % len(tables)))
        elif op == "register" and tables:
            table = tables[x % len(tables)]
            key = _key([x, x], b"ns")
            if _register_one(pool, table[x % len(table)], key):
                content[table[x % len(table)]] = key
        elif op == "hit":
            key = _key([x, x], b"ns")
            found = pool.find_prefix([key], 1)
            if found:
                assert pool.key_of(found[0]) == key == content[found[0]]
                reviving = pool.num_reviving(found)
                before = pool.num_free
                pool.take_cached(found)
                assert pool.num_free == before - reviving
                tables.append(found)
        elif op == "reset":
            dropped = pool.reset_cache()
            assert dropped >= 0 and pool.num_cached == 0
        pool.check_invariants(tables, shared_ok=True)
        # used + free (plain and cached) is the whole pool
        assert pool.num_used + pool.num_free == num_blocks
    for table in tables:
        pool.free(table)
    pool.check_invariants([], shared_ok=True)
    assert pool.num_free == num_blocks


def test_eviction_takes_plain_free_blocks_first_then_lru_deepest_first() -> None:
    pool = BlockPool(6, block_size=1)
    first = pool.allocate(3)
    assert first is not None
    keys = [_key([i], b"") for i in range(3)]
    for block, key in zip(first, keys, strict=True):
        assert _register_one(pool, block, key)
    pool.free(first)  # released together: the deepest (last) is evicted first
    plain = pool.allocate(3)
    assert plain is not None and not set(plain) & set(first)  # never-registered blocks first
    assert pool.num_cached == 3
    one = pool.allocate(1)
    assert one == [first[2]] and pool.find_prefix(keys, 3) == first[:2]
    two = pool.allocate(1)
    assert two == [first[1]] and pool.find_prefix(keys, 3) == first[:1]


def test_register_blocks_skips_taken_keys_and_eviction_takes_the_oldest_in_one_go() -> None:
    pool = BlockPool(6, block_size=1)
    table = pool.allocate(4)
    assert table is not None
    keys = [_key([i], b"") for i in range(4)]
    assert _register_one(pool, table[1], keys[1])
    other = pool.allocate(1)
    assert other is not None and _register_one(pool, other[0], keys[2])  # keys[2] is taken
    assert pool.register_blocks(table, keys, 0, 4) == 2
    assert [pool.key_of(b) for b in table] == [keys[0], keys[1], None, keys[3]]
    assert pool.find_prefix(keys, 4) == [table[0], table[1], other[0], table[3]]
    with pytest.raises(ValueError, match="not owned"):
        pool.register_blocks([5], [_key([9], b"")], 0, 1)  # block 5 is free
    pool.free(table)  # released deepest first: table[3], then table[1], table[0] (cached)
    pool.free(other)
    taken = pool.allocate(4)  # one plain free block (table[2] and the last never-used one)...
    assert taken is not None and taken[:2] == [table[2], 5]
    assert taken[2:] == [table[3], table[1]]  # ...then the two oldest cached, oldest first
    assert pool.num_evicted == 2 and pool.find_prefix(keys, 4) == [table[0]]
    pool.check_invariants([taken], shared_ok=True)
