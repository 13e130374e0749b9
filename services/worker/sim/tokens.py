"""Deterministic simulated tokens: the n-th output token of a request is a pure function of
(its seed, n), so a preempted and recomputed request emits the same tokens again, and two runs
of one workload emit the same text. Tokens are never an end-of-sequence id nor one of the
request's stop ids unless `eos_probability` asks for end-of-sequence tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.protocol.sampling import SamplingParams

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STEP = 0xD1B54A32D192ED03  # odd: spreads consecutive n across the 64-bit space


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a cheap, well-spread 64-bit hash of a 64-bit integer."""
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """`mix64` over a uint64 array [N], bit for bit (numpy's uint64 arithmetic wraps mod 2**64,
    as the masks do)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def request_seed(rid: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> int:
    """The 64-bit stream seed of a request.

    Its `seed` when given; for greedy requests the prompt (a greedy model's output depends only
    on its prompt); else the request id. Stable across processes (no salted `hash()`).
    """
    if sampling.seed is not None:
        return mix64(sampling.seed & _MASK)
    if sampling.greedy:
        data = b"p" + b",".join(str(t).encode() for t in prompt_ids)
    else:
        data = b"r" + rid.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class TokenSource:
    """Draws output tokens from [low, high), skipping forbidden ids (eos and stop ids)."""

    low: int
    high: int
    eos_token_ids: tuple[int, ...]
    eos_probability: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high - 1:
            raise ValueError("token range must hold at least two ids")

    def token(self, seed: int, n: int, forbidden: frozenset[int], allow_eos: bool) -> int:
        """The n-th (0-based) output token of the stream `seed`."""
        z = mix64(seed ^ ((n * _STEP) & _MASK))
        if allow_eos and self.eos_token_ids:
            if (mix64(z) >> 11) / float(1 << 53) < self.eos_probability:
                return self.eos_token_ids[0]
        span = self.high - self.low
        tok = self.low + z % span
        if tok not in forbidden:  # the common case: one hash, one lookup
            return tok
        for _ in range(span):  # a forbidden id moves to the next allowed one (bounded walk)
            tok = self.low + (tok - self.low + 1) % span
            if tok not in forbidden:
                return tok
        raise ValueError("every id in the simulated token range is forbidden")

    def first_choices(self, seeds: np.ndarray, ns: np.ndarray) -> np.ndarray:
        """[N] uint64 seeds and output indices -> [N] int64: what `token` returns when the
        draw is neither end-of-sequence nor forbidden (the caller redraws those rows with
        `token`), computed over arrays: a batch of decodes costs no Python per sequence."""
        with np.errstate(over="ignore"):
            z = mix64_array(seeds ^ (ns * np.uint64(_STEP)))
        return (z % np.uint64(self.high - self.low)).astype(np.int64) + self.low

    def forbidden_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """Ids a request must never receive by chance: eos and its own stop ids."""
        return frozenset(self.eos_token_ids) | frozenset(sampling.stop_token_ids)
