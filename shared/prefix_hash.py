"""Content keys of full KV blocks, for automatic prefix caching.

A full block's key is BLAKE2b-128 over (the parent block's key, the block's token ids, the cache
namespace). The parent's key makes a key stand for the whole prefix up to the block's end, so two
tables share a block only when every earlier token agrees too; the namespace holds whatever else
changes the KV of the same tokens (the model and its dtype today, LoRA or multimodal extras
later). The scheduler's block pool keys its cache with these, and a data-parallel router that
wants to know which rank holds a prefix computes the very same keys from the same function.

The scheduler keeps its keys as Python ints (`extend_int_block_keys`: the same digest, read
little-endian): a 128-bit int is a 48-byte object, while a 16-byte `bytes` is 49 bytes and lands
in the allocator's 64-byte size class together with every list header. A pool holds ~10^5 keys;
as bytes they spread the lists the scheduler touches per decode (token ids, block tables) over
more memory, which measurably slowed its per-step path (docs/PERFORMANCE.md §9, third round).

Why BLAKE2b with a 16-byte digest: a collision would make a request silently read another
prompt's KV, so the key must be collision resistant even against prompts chosen by an adversary
(Python's `hash()` is 64 bits and, for ints, not randomized; vLLM moved from it to SHA-256 for
this reason). 128 bits leave a birthday bound of ~2^64 blocks; BLAKE2b is in the standard library
and hashes a 16-token block in about a microsecond on this CPU.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Optional

DIGEST_BYTES = 16  # 128-bit keys
_SWAP = sys.byteorder != "little"  # keys are over little-endian uint32 token ids everywhere


def cache_namespace(model_name: str, dtype: str, extra: str = "") -> bytes:
    """What, besides tokens, decides a block's KV: blocks of different namespaces never match.
    It stands in for the parent key of a prefix's first block, so it reaches every key.

    Called once when the worker handshake says which model and dtype the KV cache holds; the
    scheduler passes the weights' quantization and the KV storage dtype as `extra` (the same
    tokens give other K/V under another number format).
    """
    text = f"model={model_name}\x1fdtype={dtype}\x1fextra={extra}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def block_key(parent: Optional[bytes], token_ids: Sequence[int], namespace: bytes) -> bytes:
    """The key of one full block: `token_ids` (block_size ids) after the prefix keyed `parent`
    (None for a prompt's first block, whose parent is then the namespace). Token ids are hashed
    as little-endian unsigned 32-bit integers. ~1-2 us per 16-token block here: the scheduler
    computes keys off its result -> plan path where it can (see services/scheduler)."""
    packed = array("I", token_ids)
    if _SWAP:
        packed.byteswap()
    return hashlib.blake2b(
        (parent or namespace) + packed.tobytes(), digest_size=DIGEST_BYTES
    ).digest()


def extend_block_keys(
    keys: list[bytes], token_ids: Sequence[int], block_size: int, namespace: bytes, num_full: int
) -> None:
    """Append to `keys` (the keys of `token_ids`' first len(keys) blocks) until it holds the
    keys of its first `num_full` full blocks. Keys depend on tokens only, so a request computes
    each once, however often it is looked up or preempted."""
    parent = keys[-1] if keys else None
    for i in range(len(keys), num_full):  # a hot loop only while a prompt arrives
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], namespace)
        keys.append(parent)


def extend_int_block_keys(
    keys: list[int], token_ids: Sequence[int], block_size: int, namespace: bytes, num_full: int
) -> None:
    """`extend_block_keys` with each key as the integer of its digest (little-endian), the form
    the scheduler's block pool keeps (see the module docstring for why)."""
    parent = keys[-1].to_bytes(DIGEST_BYTES, "little") if keys else None
    for i in range(len(keys), num_full):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], namespace)
        keys.append(int.from_bytes(parent, "little"))
