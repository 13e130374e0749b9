"""What the gateway learns about one choice, independent of the protocol client's classes.

`delta_from_chunk` and `end_from_done` are the only places that read the client's `Chunk` and
`Done` (shared/client/types.py; their maps are docs/protocol.md §4's), so a change stays here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from services.gateway.errors import ApiError


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, by token id."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of choice `index` since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Engine-measured seconds (docs/protocol.md `done.timings`); None when it did not happen."""

    queue_s: Optional[float] = None
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    e2e_s: Optional[float] = None


@dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """Choice `index` is over: finished (`error` None) or failed (`error` set)."""

    index: int
    finish_reason: Optional[str]
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    times: RequestTimes = field(default_factory=RequestTimes)
    error: Optional[ApiError] = None
    num_cached_tokens: int = 0  # prompt tokens found in the engine's prefix cache


ChoiceEvent = TextDelta | ChoiceEnd


def delta_from_chunk(index: int, chunk: Any) -> TextDelta:
    """A client `Chunk` (text, token_ids, logprobs) -> TextDelta."""
    token_ids = list(chunk.token_ids)
    return TextDelta(index, chunk.text, token_ids, logprobs_from_wire(token_ids, chunk.logprobs))


def end_from_done(index: int, done: Any) -> ChoiceEnd:
    """A client `Done` (finish_reason, usage, timings) -> ChoiceEnd."""
    usage = done.usage or {}
    timings = done.timings or {}
    return ChoiceEnd(
        index=index,
        finish_reason=done.finish_reason,
        num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
        num_output_tokens=int(usage.get("completion_tokens") or 0),
        num_cached_tokens=int(usage.get("num_cached_tokens") or 0),
        times=RequestTimes(
            queue_s=_seconds(timings.get("queue_s")),
            ttft_s=_seconds(timings.get("ttft_s")),
            tpot_s=_seconds(timings.get("tpot_s")),
            e2e_s=_seconds(timings.get("e2e_s")),
        ),
    )


def logprobs_from_wire(
    token_ids: Sequence[int], wire: Optional[Sequence[Mapping[str, Any]]]
) -> list[TokenLogprob]:
    """Protocol logprobs (one map per token: logprob, top_token_ids, top_logprobs)."""
    if not wire:
        return []
    out: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, wire, strict=False):
        top_ids = entry.get("top_token_ids") or []
        top_lps = entry.get("top_logprobs") or []
        out.append(
            TokenLogprob(
                token_id=int(token_id),
                logprob=float(entry.get("logprob", 0.0)),
                top=[(int(t), float(lp)) for t, lp in zip(top_ids, top_lps, strict=False)],
            )
        )
    return out


def _seconds(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
