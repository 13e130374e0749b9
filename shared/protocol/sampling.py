"""Sampling parameters: what the worker needs to turn logits into a token.

Stop *strings* are a frontend concern (they need text); stop *token ids* and the length
limit are enforced by the scheduler; everything that touches logits is applied by the worker.
Defaults follow OpenAI's where it has one (max_tokens 16, temperature 1, top_p 1).

Every number must be finite and every integer must fit a signed 64-bit integer (what msgpack,
torch and other languages' clients hold). A temperature below GREEDY_TEMPERATURE_FLOOR is
greedy: dividing logits by 1e-300 underflows to a division by zero in float32.

Structured outputs: `constraint` restricts every sampled token to those a grammar allows
(shared/constraints.py compiles it; the frontend at admission, the worker again for its
matchers); `logit_bias` adds a number to chosen logits before anything else (OpenAI's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
GREEDY_TEMPERATURE_FLOOR = 1e-5  # temperatures below it (0 included) mean greedy
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_CONSTRAINT_BYTES = 64 << 10  # the spec's text; larger: constraint_too_large
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
POOLING_KINDS = ("last", "mean")  # embeddings: the last position's hidden state, or the mean


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. `spec` by kind: json_schema: the schema as JSON text;
    json_object: "" (any JSON object); regex: the pattern (the whole output matches it);
    grammar: a Lark grammar (llguidance's dialect; GBNF is converted); choice: a JSON list of
    the strings allowed. JSON comes out compact (no free whitespace) unless the schema's
    "x-guidance" options say otherwise."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}")
        if not isinstance(self.spec, str):
            raise ValueError("a constraint's spec must be a string")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # < GREEDY_TEMPERATURE_FLOOR (0 included) means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: Optional[int] = None  # None disables; else >= 1
    min_p: float = 0.0  # in [0, 1]
    seed: Optional[int] = None  # None: the worker derives one from the request id
    repetition_penalty: float = 1.0  # > 0; 1 disables (HF/CTRL style, over prompt + output)
    presence_penalty: float = 0.0  # in [-2, 2] (OpenAI style, over output tokens)
    frequency_penalty: float = 0.0  # in [-2, 2] (OpenAI style, over output tokens)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: no logprobs; k >= 0: chosen token's + top-k
    constraint: Optional[Constraint] = None  # None: any token may be sampled
    # token id (decimal text, as OpenAI's JSON keys) -> bias in [-100, 100], added to the logit
    logit_bias: dict[str, float] = field(default_factory=dict)
    # An embedding request (`embed`, /v1/embeddings): the worker also returns the pooled,
    # L2-normalised final hidden state of the prompt when it samples its one token (max_tokens
    # 1, discarded). "mean" reads every position, so the scheduler never starts it from the
    # prefix cache; "last" may (its last position is always computed).
    pooling: Optional[str] = None

    def __post_init__(self) -> None:
        problems = sampling_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_FLOOR

    def logit_bias_ids(self) -> list[tuple[int, float]]:
        """`logit_bias` as (token id, bias) pairs (keys were checked to be decimal ids)."""
        return [(int(k), float(v)) for k, v in self.logit_bias.items()]


def sampling_problems(p: SamplingParams) -> list[str]:
    """Every reason `p` is invalid, worded for a client; empty when valid."""
    out: list[str] = []
    if not _is_int(p.max_tokens) or not 0 < p.max_tokens <= INT64_MAX:
        out.append("max_tokens must be an integer in [1, 2^63)")
    if not _is_num(p.temperature) or p.temperature < 0:
        out.append("temperature must be a number >= 0")
    if not _is_num(p.top_p) or not 0.0 < p.top_p <= 1.0:
        out.append("top_p must be in (0, 1]")
    if p.top_k is not None and (not _is_int(p.top_k) or not 1 <= p.top_k <= INT64_MAX):
        out.append("top_k must be an integer >= 1 (or null to disable)")
    if not _is_num(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        out.append("min_p must be in [0, 1]")
    if p.seed is not None and (not _is_int(p.seed) or not INT64_MIN <= p.seed <= INT64_MAX):
        out.append("seed must be a signed 64-bit integer")
    if not _is_num(p.repetition_penalty) or p.repetition_penalty <= 0:
        out.append("repetition_penalty must be > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_num(v) or not -2.0 <= v <= 2.0:
            out.append(f"{name} must be in [-2, 2]")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        out.append(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")
    elif not all(_is_int(t) and 0 <= t <= INT64_MAX for t in p.stop_token_ids):
        out.append("stop_token_ids must be non-negative integers")
    if p.logprobs is not None and (
        not isinstance(p.logprobs, int) or not 0 <= p.logprobs <= MAX_TOP_LOGPROBS
    ):
        out.append(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    out.extend(_structured_problems(p))
    if p.pooling is not None and (p.pooling not in POOLING_KINDS or p.max_tokens != 1):
        out.append(f"pooling must be one of {', '.join(POOLING_KINDS)}, with max_tokens 1")
    return out


def _structured_problems(p: SamplingParams) -> list[str]:
    out: list[str] = []
    if p.constraint is not None and p.ignore_eos:
        out.append(
            "ignore_eos cannot be combined with a constraint (it ends where the grammar does)"
        )
    bias = p.logit_bias
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        out.append(f"logit_bias maps at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases")
    elif not all(_is_token_key(k) and _is_num(v) and -100 <= v <= 100 for k, v in bias.items()):
        out.append("logit_bias maps token ids (decimal strings) to numbers in [-100, 100]")
    return out


def _is_token_key(key: object) -> bool:
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18


def _is_num(v: object) -> bool:
    """A finite number: NaN and +-Infinity are refused everywhere."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) if isinstance(v, float) else INT64_MIN <= v <= INT64_MAX


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
