"""What the Python client hands back: completions, chunks, the done event and its error type.

Maps on the wire (docs/protocol.md) become these frozen dataclasses; `usage` and `timings` stay
maps (their keys are documented in the protocol) so new keys reach callers without a release.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from shared.protocol.client_channel import encode_client_message
from shared.protocol.errors import ErrorCode, short_repr


class EngineError(Exception):
    """An `error` reply from the engine, or the engine could not be reached (code
    `engine_unreachable`). `code` is one of the stable codes of docs/protocol.md §6."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed `chunk`: new text (never a split UTF-8 character) and the new token ids."""

    id: str
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[str, Any]]]
    received_at: float  # time.time() when the client received it


@dataclass(frozen=True, slots=True)
class Done:
    """The `done` event that ends a request (streamed or not)."""

    id: str
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: Union[str, int, None]
    usage: dict[str, int]  # prompt_tokens, completion_tokens, total_tokens
    timings: dict[str, Optional[float]]  # queue_s, ttft_s, tpot_s, e2e_s


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: what `generate()` returns."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, Optional[float]]
    logprobs: Optional[list[dict[str, Any]]]
    stop_reason: Union[str, int, None] = None


@dataclass(frozen=True, slots=True)
class Embedding:
    """An `embed`'s answer: the prompt's pooled hidden state, L2-normalised."""

    id: str
    embedding: list[float]  # [hidden size]
    pooling: str  # "last" | "mean"
    usage: dict[str, int]  # prompt_tokens (completion_tokens 0)


def embedding_from_reply(msg: dict[str, Any]) -> Embedding:
    """An `embed`'s last reply; EngineError on `error` (or a `done`: it was aborted)."""
    if msg["type"] == "error":
        raise error_from_wire(msg)
    if msg["type"] != "embedding":
        raise EngineError(ErrorCode.INTERNAL, f"embed ended with {msg['type']!r}")
    return Embedding(msg["id"], msg["embedding"], msg["pooling"], msg["usage"])


def chunk_from_wire(msg: dict[str, Any]) -> Chunk:
    return Chunk(
        id=msg["id"],
        text=msg.get("text") or "",
        token_ids=list(msg.get("token_ids") or []),
        logprobs=msg.get("logprobs"),
        received_at=time.time(),
    )


def done_from_wire(msg: dict[str, Any]) -> Done:
    return Done(
        id=msg["id"],
        finish_reason=msg.get("finish_reason") or "stop",
        stop_reason=msg.get("stop_reason"),
        usage=dict(msg.get("usage") or {}),
        timings=dict(msg.get("timings") or {}),
    )


def error_from_wire(msg: dict[str, Any]) -> EngineError:
    return EngineError(str(msg.get("code") or ErrorCode.INTERNAL), str(msg.get("message") or ""))


def completion_from_done(msg: dict[str, Any]) -> Completion:
    """A non-streaming `done` carries the whole text."""
    done = done_from_wire(msg)
    return completion_from_parts(
        done, msg.get("text") or "", list(msg.get("token_ids") or []), msg.get("logprobs")
    )


def completion_from_chunks(done: Done, chunks: list[Chunk]) -> Completion:
    logprobs = None
    if any(c.logprobs is not None for c in chunks):
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    token_ids = [t for c in chunks for t in c.token_ids]
    return completion_from_parts(done, "".join(c.text for c in chunks), token_ids, logprobs)


def completion_from_parts(
    done: Done, text: str, token_ids: list[int], logprobs: Optional[list[dict[str, Any]]]
) -> Completion:
    return Completion(
        id=done.id,
        text=text,
        token_ids=token_ids,
        finish_reason=done.finish_reason,
        usage=done.usage,
        timings=done.timings,
        logprobs=logprobs,
        stop_reason=done.stop_reason,
    )


# keyword parameters that are not sampling params: the map's own fields
_OWN_FIELDS = ("tools", "traceparent", "slo_class", "ttft_ms", "tpot_ms", "on_slo_miss")


def request_fields(
    prompt: Optional[str],
    messages: Optional[list[dict[str, Any]]],
    prompt_token_ids: Optional[list[int]],
    stream: bool,
    priority: int,
    params: dict[str, Any],
) -> dict[str, Any]:
    """The fields of a `generate` map (nil params are left out: the engine's defaults apply).
    `tools` and `traceparent` given among the keyword parameters are the map's own fields (a
    chat's tools; the W3C trace context of the caller's span)."""
    fields = {
        "prompt": prompt,
        "messages": messages,
        "prompt_token_ids": prompt_token_ids,
        "stream": stream,
        "priority": priority,
        "params": {k: v for k, v in params.items() if v is not None and k not in _OWN_FIELDS},
    }
    for name in _OWN_FIELDS:
        if params.get(name) is not None:
            fields[name] = params[name]
    return fields


def generate_frame(
    rid: str,
    fields: dict[str, Any],
    max_frame_bytes: int,
) -> bytes:
    """The `generate` frame, or EngineError when it cannot be sent: a value msgpack cannot hold
    (an integer beyond 64 bits: invalid_field) or a frame over the frontend's limit
    (frame_too_large, checked here so that the shared connection is never dropped)."""
    try:
        frame = encode_client_message("generate", rid, **fields)
    except (OverflowError, TypeError, ValueError) as exc:
        message = f"the request cannot be encoded: {type(exc).__name__}: {short_repr(str(exc))}"
        raise EngineError(ErrorCode.INVALID_FIELD, message) from None
    if len(frame) > max_frame_bytes:
        message = f"request of {len(frame)} bytes > the frame limit of {max_frame_bytes}"
        raise EngineError(ErrorCode.FRAME_TOO_LARGE, message)
    return frame
