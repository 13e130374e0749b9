"""Structured-output constraints compiled with llguidance, for the frontend and the worker.

The frontend compiles each request's constraint at admission (a bad one is refused before the
reply starts: `ConstraintError` carries a stable code); the worker compiles it again for its
matchers (services/worker/constraints.py). Both go through `GrammarCache`, a bounded LRU of
compiled matchers keyed by the constraint: a repeated schema costs one dictionary look-up and a
copy of the pristine matcher (llguidance shares the compiled grammar between copies).

Why llguidance (the figures: docs/lab/2026-12-structured-outputs.md): it compiles a schema in
well under a millisecond where xgrammar takes tens (hundreds for the largest of our set), and
its worst per-token mask is lower; it rolls back k tokens (speculative decoding); it needs no other
package. It releases the GIL while it compiles and computes masks.

Limits (documented in docs/protocol.md): the spec's text is at most MAX_CONSTRAINT_BYTES; the
grammar at most MAX_GRAMMAR_SYMBOLS symbols and MAX_LEXER_FUEL of initial lexer work
(`constraint_too_large`); one compile at most COMPILE_TIMEOUT_S seconds of wall clock
(`constraint_too_slow`). Anything else the library refuses (bad JSON, a bad regex, an
unsupported schema keyword: its message names it) is `invalid_constraint`.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Optional

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import MAX_CONSTRAINT_BYTES, Constraint

MAX_GRAMMAR_SYMBOLS = 200_000
MAX_LEXER_FUEL = 1_000_000  # llguidance's unit, ~50 per microsecond
COMPILE_TIMEOUT_S = 2.0
CACHE_SIZE = 256  # compiled constraints kept per process
# JSON without free whitespace: max_tokens is spent on content (a schema's own "x-guidance"
# options come after these defaults and may ask for whitespace)
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
LIMITS = LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=MAX_LEXER_FUEL,
                        verbose_errors=False)  # fmt: skip


class ConstraintError(ValueError):
    """A constraint that cannot be used; `code` is a stable ErrorCode string."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def load_tokenizer(folder: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """The model's vocabulary for llguidance, from tokenizer.json (~0.3 s for 49k tokens; once
    per process). `vocab_size` is the logits' width (masks have one bit per logit)."""
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (its specification as the library reads it);
    ConstraintError when the spec cannot even be read."""
    kind, spec = constraint.kind, constraint.spec
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(
            ErrorCode.CONSTRAINT_TOO_LARGE,
            f"the {kind} is over {MAX_CONSTRAINT_BYTES} bytes",
        )
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.loads(spec))
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", spec)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(ErrorCode.INVALID_CONSTRAINT, f"{kind}: {exc}") from None


def new_matcher(tokenizer: LLTokenizer, constraint: Constraint) -> LLMatcher:
    """Compile a constraint into a pristine matcher (the GIL is released meanwhile);
    ConstraintError when the library refuses it."""
    matcher = LLMatcher(tokenizer, grammar_text(constraint), limits=LIMITS, log_level=0)
    if matcher.is_error():
        raise _refusal(constraint.kind, matcher.get_error())
    return matcher


def _refusal(kind: str, error: str) -> ConstraintError:
    first = error.strip().splitlines()[0] if error.strip() else "refused"
    code = ErrorCode.CONSTRAINT_TOO_LARGE if "too big" in first else ErrorCode.INVALID_CONSTRAINT
    return ConstraintError(code, f"{kind}: {first[:300]}")


def _timed_compile(tokenizer: LLTokenizer, constraint: Constraint) -> tuple[LLMatcher, float]:
    """A new matcher and the seconds its compile took (run on the cache's helper thread)."""
    start = time.perf_counter()
    compiled = new_matcher(tokenizer, constraint)
    return compiled, time.perf_counter() - start


class GrammarCache:
    """Compiled constraints by (kind, spec), least recently used out past `size`. `matcher`
    compiles on a helper thread and waits at most `timeout_s`: a compile that runs longer is
    refused (`constraint_too_slow`) and left to finish in the background, its result dropped.
    One owner thread calls it (the frontend's loop, the worker's mask thread)."""

    def __init__(
        self,
        tokenizer: LLTokenizer,
        size: int = CACHE_SIZE,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self.timeout_s = timeout_s
        self._compiled: OrderedDict[Constraint, LLMatcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.num_hits = 0
        self.num_compiles = 0

    def matcher(self, constraint: Constraint) -> LLMatcher:
        """A fresh matcher at the start of the constraint; ConstraintError when refused."""
        pristine = self._compiled.get(constraint)
        if pristine is not None:
            self._compiled.move_to_end(constraint)
            self.num_hits += 1
            return pristine.deep_copy()
        future = self._pool.submit(_timed_compile, self.tokenizer, constraint)
        try:
            pristine, compile_s = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            compile_s = None
        # the compile's own clock decides too: on a busy host this thread may wake only after
        # a slow compile ended, and the same constraint must get the same answer either way
        if compile_s is None or compile_s > self.timeout_s:
            raise ConstraintError(
                ErrorCode.CONSTRAINT_TOO_SLOW,
                f"the {constraint.kind} took over {self.timeout_s:g} s to compile",
            )
        self._keep_matcher(constraint, pristine)
        return pristine.deep_copy()

    def check(self, constraint: Optional[Constraint]) -> Optional[ConstraintError]:
        """Why a request's constraint cannot be used, or None (no constraint, or it compiles)."""
        if constraint is None:
            return None
        try:
            self.matcher(constraint)
        except ConstraintError as exc:
            return exc
        return None

    def _keep_matcher(self, constraint: Constraint, pristine: LLMatcher) -> None:
        self.num_compiles += 1
        self._compiled[constraint] = pristine
        self._compiled.move_to_end(constraint)
        while len(self._compiled) > self.size:
            self._compiled.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
