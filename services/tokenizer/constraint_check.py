"""Admission of a request's structured-output parameters (after its prompt was checked):
`logit_bias` ids inside the vocabulary, and the constraint compiled (shared/constraints.py),
so a schema that cannot be used is refused before the reply starts, with its own code
(`invalid_constraint`, `constraint_too_large`, `constraint_too_slow`) and for that request only.

Compiled constraints stay in a bounded cache (a repeated schema is a look-up); the worker keeps
its own. The vocabulary for llguidance is built on the first constrained request (~0.3 s once),
from this frontend's tokenizer and the engine's vocabulary size.
"""

from __future__ import annotations

from typing import Optional

from services.tokenizer.admission import Rejection
from services.tokenizer.text_codec import TextCodec
from shared.constraints import GrammarCache
from shared.protocol.engine_channel import EngineReady
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams


class ConstraintCheck:
    """Owned by the request flow; called on the frontend's one thread, once per `generate`."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._cache: Optional[GrammarCache] = None
        self._vocab: Optional[tuple[int, tuple[int, ...]]] = None  # what the cache was built for

    @property
    def cache(self) -> Optional[GrammarCache]:
        """The compiled constraints (None before the first constrained request)."""
        return self._cache

    def problem(self, sampling: SamplingParams, engine: EngineReady) -> Optional[Rejection]:
        """Why the request's structured-output parameters cannot run on this engine, or None."""
        bad = [t for t, _ in sampling.logit_bias_ids() if t >= engine.vocab_size]
        if bad:
            return Rejection(
                ErrorCode.INVALID_PARAMS,
                f"logit_bias token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
            )
        if sampling.constraint is None:
            return None
        error = self._cache_for(engine).check(sampling.constraint)
        return None if error is None else Rejection(error.code, error.message)

    def _cache_for(self, engine: EngineReady) -> GrammarCache:
        vocab = (engine.vocab_size, tuple(engine.eos_token_ids))
        if self._cache is None or self._vocab != vocab:
            if self._cache is not None:
                self._cache.close()
            tokenizer = self._codec.grammar_tokenizer(engine.vocab_size, engine.eos_token_ids)
            self._cache, self._vocab = GrammarCache(tokenizer), vocab
        return self._cache
