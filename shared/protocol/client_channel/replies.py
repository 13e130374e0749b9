"""Frontend -> client frames (docs/protocol.md): every reply the frontend sends is built here,
so the frontend and the tests agree on one wire shape. Plain msgpack maps with `type`, `v`, `id`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import msgpack

from shared.protocol.client_channel.messages import PROTOCOL_VERSION
from shared.protocol.worker_channel import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the engine's prefix cache

    def to_wire(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "num_cached_tokens": self.num_cached_tokens,
        }


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds; None when it did not happen (e.g. no token before an abort)."""

    queue_s: Optional[float]
    ttft_s: Optional[float]
    tpot_s: Optional[float]
    e2e_s: Optional[float]

    def to_wire(self) -> dict[str, Optional[float]]:
        return {
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
        }


def encode_reply(kind: str, id: Optional[str], **fields: Any) -> bytes:
    return msgpack.packb(
        {"type": kind, "v": PROTOCOL_VERSION, "id": id, **fields}, use_bin_type=True
    )


def logprobs_to_wire(logprobs: list[TokenLogprobs]) -> list[dict[str, Any]]:
    return [
        {"logprob": lp.logprob, "top_token_ids": lp.top_token_ids, "top_logprobs": lp.top_logprobs}
        for lp in logprobs
    ]


def chunk_reply(
    id: str, text: str, token_ids: list[int], logprobs: Optional[list[TokenLogprobs]]
) -> bytes:
    wire_lp = None if logprobs is None else logprobs_to_wire(logprobs)
    return encode_reply("chunk", id, text=text, token_ids=token_ids, logprobs=wire_lp)


def done_reply(
    id: str,
    finish_reason: str,
    stop_reason: Union[str, int, None],
    usage: Usage,
    timings: Timings,
    whole: Optional[tuple[str, list[int], Optional[list[TokenLogprobs]]]] = None,
) -> bytes:
    """`whole` = (text, token_ids, logprobs) for a non-streaming request, else None."""
    extra: dict[str, Any] = {}
    if whole is not None:
        text, token_ids, logprobs = whole
        extra = {
            "text": text,
            "token_ids": token_ids,
            "logprobs": None if logprobs is None else logprobs_to_wire(logprobs),
        }
    return encode_reply(
        "done",
        id,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        usage=usage.to_wire(),
        timings=timings.to_wire(),
        **extra,
    )


def embedding_reply(id: str, embedding: list[float], pooling: str, usage: Usage) -> bytes:
    """The answer to `embed`: the prompt's pooled hidden state, L2-normalised (float32 values)."""
    return encode_reply("embedding", id, embedding=embedding, pooling=pooling,
                        usage=usage.to_wire())  # fmt: skip


def error_reply(code: str, message: str, id: Optional[str] = None) -> bytes:
    return encode_reply("error", id, code=code, message=message)


def aborted_reply(id: str, found: bool) -> bytes:
    return encode_reply("aborted", id, found=found)


def heartbeat_reply() -> bytes:
    return encode_reply("heartbeat", None)


def health_reply(
    id: Optional[str],
    ready: bool,
    reason: Optional[str],
    model: Optional[str],
    max_model_len: Optional[int],
    vocab_size: Optional[int],
    frontend_id: str,
    engines: Optional[list[dict[str, Any]]] = None,
) -> bytes:
    """`engines`: each engine behind the frontend (engine, address, ready, reason, load,
    kv_usage); `ready` is true while at least one of them is."""
    return encode_reply(
        "health",
        id,
        ready=ready,
        reason=None if ready else reason,
        model=model,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        frontend_id=frontend_id,
        engines=engines,
    )


def reset_prefix_cache_reply(id: Optional[str], num_blocks_dropped: int) -> bytes:
    return encode_reply("reset_prefix_cache", id, num_blocks_dropped=num_blocks_dropped)


def stats_reply(
    id: Optional[str],
    ready: bool,
    frontend: dict[str, float],
    engine: Optional[dict[str, float]],
    engines: Optional[dict[str, Optional[dict[str, float]]]] = None,
) -> bytes:
    """`engine`: the engines' stats combined; `engines`: each engine's by name (None: it did
    not answer in time)."""
    return encode_reply("stats", id, ready=ready, frontend=frontend, engine=engine,
                        engines=engines)  # fmt: skip


def drain_reply(id: Optional[str], engine: str, draining: bool, num_moved: int) -> bytes:
    """The answer to `drain`: the engine, whether it now drains, and how many of this
    frontend's requests moved off it at once."""
    return encode_reply("drain", id, engine=engine, draining=draining, num_moved=num_moved)
