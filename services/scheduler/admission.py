"""Admission checks: a request that can never run is refused at once with a stable code,
never queued forever; a full waiting queue refuses with `overloaded`."""

from __future__ import annotations

from typing import Optional

from shared.protocol.errors import ErrorCode


def admission_problem(
    rid: str,
    prompt_len: int,
    *,
    is_duplicate: bool,
    max_model_len: int,
    kv_capacity: int,
    num_waiting: int,
    max_waiting: int,
) -> Optional[tuple[str, str]]:
    """(error code, message for the client) when the request must be refused, else None.

    `kv_capacity` is the token count of the whole KV pool: a prompt longer than that cannot be
    computed even with every other request preempted.
    """
    if is_duplicate:
        return ErrorCode.DUPLICATE_ID, f"request id {rid!r} is already in flight"
    if prompt_len == 0:
        return ErrorCode.INVALID_PROMPT, "the prompt has no tokens"
    if prompt_len + 1 > max_model_len:
        return ErrorCode.PROMPT_TOO_LONG, (
            f"the prompt has {prompt_len} tokens; max_model_len {max_model_len} leaves room "
            f"for at most {max_model_len - 1} prompt tokens and one output token"
        )
    if prompt_len > kv_capacity:
        return ErrorCode.PROMPT_TOO_LONG, (
            f"the prompt has {prompt_len} tokens but the whole KV cache holds {kv_capacity}"
        )
    if num_waiting >= max_waiting:
        return ErrorCode.OVERLOADED, (
            f"{num_waiting} requests are already waiting (max_waiting); try again later"
        )
    return None
