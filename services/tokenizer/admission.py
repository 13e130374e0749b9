"""A validated `generate` -> prompt token ids, checked against the model's limits.

Runs after shared/protocol/client_channel/ has checked the message's shape; what is left
needs the tokenizer (chat template, tokenization) or the engine's limits (vocabulary size,
max_model_len), which the frontend learns from the scheduler's EngineReady.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from services.tokenizer.chat_template import ChatTemplateError
from services.tokenizer.text_codec import TextCodec
from shared.protocol.client_channel import GenerateCommand
from shared.protocol.engine_channel import EngineReady
from shared.protocol.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class Rejection:
    code: str
    message: str


def prompt_ids(
    cmd: GenerateCommand, codec: TextCodec, engine: EngineReady
) -> Union[list[int], Rejection]:
    """The request's prompt as token ids, or why it cannot run on this model."""
    if cmd.messages is not None:
        try:
            ids = codec.encode_chat(cmd.messages, cmd.add_generation_prompt, cmd.tools)
        except ChatTemplateError as exc:
            return Rejection(ErrorCode.INVALID_PROMPT, str(exc))
    elif cmd.prompt is not None:
        ids = codec.encode(cmd.prompt)
    else:
        ids = list(cmd.prompt_token_ids or [])
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            return Rejection(
                ErrorCode.INVALID_TOKEN_ID,
                f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
            )
    if not ids:
        return Rejection(ErrorCode.INVALID_PROMPT, "the prompt has no tokens")
    bad_stops = [t for t in cmd.sampling.stop_token_ids if not 0 <= t < engine.vocab_size]
    if bad_stops:
        return Rejection(
            ErrorCode.INVALID_PARAMS,
            f"stop token id {bad_stops[0]} is outside the vocabulary [0, {engine.vocab_size})",
        )
    total = len(ids) + cmd.sampling.max_tokens
    if total > engine.max_model_len:
        return Rejection(
            ErrorCode.PROMPT_TOO_LONG,
            f"{len(ids)} prompt tokens + max_tokens {cmd.sampling.max_tokens} = {total} "
            f"> max_model_len {engine.max_model_len}",
        )
    return ids


def over_connection_cap(num_in_flight: int, cap: int) -> Optional[Rejection]:
    """`overloaded` once one connection has `cap` requests in flight (cap 0: no limit)."""
    if cap and num_in_flight >= cap:
        return Rejection(
            ErrorCode.OVERLOADED,
            f"this connection already has {cap} requests in flight (the per-connection "
            "limit); wait for one to end or open another connection",
        )
    return None
