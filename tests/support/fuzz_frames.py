"""Frames for fuzzing the internal sockets (tests/e2e/test_fuzz_internal.py): random msgpack
values, random bytes, valid messages of a channel with 1-3 fields set to random values,
deleted or added, messages of the wrong channel, and byte-level mutations of each (truncated,
a bit flipped, a slice repeated, garbage appended). Drawn from a seeded random.Random: the
same seed, the same frames.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import msgpack

from shared.protocol.codec import encode

_ODD_NUMBERS = [math.nan, math.inf, -math.inf, 1e-300, -0.0, 2**63 - 1, -(2**63), 2**64 - 1, -1]


def random_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random msgpack value: nil, bools, integers up to 64 bits, floats (NaN, infinities),
    strings, bytes, and lists and maps of them nested up to 3 deep."""
    kind = rnd.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice([rnd.randrange(-(2**63), 2**64), rnd.randrange(-5, 300)])
    if kind == 3:
        return rnd.choice([rnd.uniform(-1e6, 1e6), rnd.choice(_ODD_NUMBERS)])
    if kind == 4:
        return "".join(chr(rnd.randrange(32, 0x2FF)) for _ in range(rnd.randrange(12)))
    if kind == 5:
        return rnd.randbytes(rnd.randrange(12))
    if kind == 6:
        return rnd.choice(["step_plan", "step_result", "submit_request", "", "worker-0"])
    if kind == 7:
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(5))]
    return {_key(rnd): random_value(rnd, depth + 1) for _ in range(rnd.randrange(5))}


def _key(rnd: random.Random) -> Any:
    return rnd.choice(["type", "rid", "step_id", "token_ids", "x", rnd.randrange(-3, 3)])


def mutated(rnd: random.Random, frame: bytes) -> bytes:
    """A valid frame with 1-3 of its fields (or of a nested map's) set to a random value,
    deleted, or added."""
    wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    for _ in range(rnd.randrange(1, 4)):
        target = wire
        nested = [k for k, v in wire.items() if isinstance(v, dict)]
        if nested and rnd.random() < 0.3:
            target = wire[rnd.choice(nested)]
        keys = list(target)
        key = rnd.choice(keys) if keys and rnd.random() < 0.8 else _key(rnd)
        if rnd.random() < 0.25:
            target.pop(key, None)
        else:
            target[key] = random_value(rnd)
    return msgpack.packb(wire, use_bin_type=True)


def byte_mutation(rnd: random.Random, frame: bytes) -> bytes:
    """One byte-level change: truncated, a bit flipped, a slice repeated, garbage appended."""
    cut = rnd.randrange(len(frame) + 1)
    kind = rnd.randrange(4)
    if kind == 0:
        return frame[:cut]
    if kind == 1:
        flipped = bytearray(frame or b"\x00")
        flipped[cut % len(flipped)] ^= 1 << rnd.randrange(8)
        return bytes(flipped)
    if kind == 2:
        return frame[:cut] + frame[cut // 2 : cut] + frame[cut:]
    return frame + rnd.randbytes(rnd.randrange(1, 16))


def fuzz_frames(
    rnd: random.Random, valid: Sequence[Any], foreign: Sequence[Any], n: int
) -> list[bytes]:
    """`n` frames for a socket whose channel's messages include `valid` (seeds for mutation)
    and that must refuse `foreign` ones (another channel's, or the wrong direction's)."""
    seeds = [encode(m) for m in valid]
    others = [encode(m) for m in foreign]
    out: list[bytes] = []
    while len(out) < n:
        roll = rnd.random()
        if roll < 0.2:
            frame = msgpack.packb(random_value(rnd), use_bin_type=True)
        elif roll < 0.3:
            frame = rnd.randbytes(rnd.randrange(64))
        elif roll < 0.35:
            frame = rnd.choice(others)
        elif roll < 0.75:
            frame = mutated(rnd, rnd.choice(seeds))
        else:
            frame = byte_mutation(rnd, rnd.choice(seeds + others))
        out.append(frame)
    return out
