"""A scheduler `Request` built by hand for unit tests of one scheduler part (a queue, the step
builder, the draft budget): a prompt of one repeated token, default sampling, no stop ids."""

from __future__ import annotations

from services.scheduler.request import Request
from shared.protocol.sampling import SamplingParams


def make_request(
    rid: str,
    prompt_len: int = 8,
    *,
    seq_no: int = 0,
    priority: int = 0,
    arrival_time: float = 0.0,
    num_computed_tokens: int = 0,
    max_len: int = 4096,
) -> Request:
    """A waiting request of `prompt_len` prompt tokens, `num_computed_tokens` of them in the
    cache."""
    return Request(
        rid=rid,
        token_ids=[5] * prompt_len,
        num_prompt_tokens=prompt_len,
        sampling=SamplingParams(),
        priority=priority,
        seq_no=seq_no,
        arrival_time=arrival_time,
        max_len=max_len,
        stop_ids=frozenset(),
        num_computed_tokens=num_computed_tokens,
    )
