"""Stable error codes (snake_case strings). Clients match on these; never rename one.

The table with meanings lives in docs/protocol.md.
"""

import reprlib


class ErrorCode:
    # framing and message shape
    MALFORMED_MESSAGE = "malformed_message"  # not msgpack, or not a map
    UNKNOWN_TYPE = "unknown_type"  # `type` missing or not known
    INVALID_FIELD = "invalid_field"  # a field is missing or has the wrong type
    UNSUPPORTED_VERSION = "unsupported_version"  # `v` is not 1
    FRAME_TOO_LARGE = "frame_too_large"  # frame over the configured size limit
    # request content
    INVALID_PROMPT = "invalid_prompt"  # empty, or not exactly one of prompt/messages/ids
    INVALID_PARAMS = "invalid_params"  # sampling parameter out of range
    INVALID_TOKEN_ID = "invalid_token_id"  # prompt token id outside the vocabulary
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt (+ max_tokens) exceeds max_model_len
    INVALID_CONSTRAINT = "invalid_constraint"  # a schema/grammar/regex that does not compile
    CONSTRAINT_TOO_LARGE = "constraint_too_large"  # over the documented size limits
    CONSTRAINT_TOO_SLOW = "constraint_too_slow"  # its compile ran past the time-out
    DUPLICATE_ID = "duplicate_id"  # id already in flight on this connection
    EMBEDDINGS_UNSUPPORTED = "embeddings_unsupported"  # the worker computes no embeddings (sim)
    # engine state
    NOT_READY = "not_ready"  # no worker handshake yet (or worker lost)
    OVERLOADED = "overloaded"  # waiting queue full
    SLO_UNATTAINABLE = "slo_unattainable"  # its latency target is predicted out of reach
    WORKER_FAILED = "worker_failed"  # the worker died or failed the step
    SHUTTING_DOWN = "shutting_down"  # draining: no new requests
    ENGINE_UNREACHABLE = "engine_unreachable"  # scheduler lost, or a client's timeout expired
    INTERNAL = "internal_error"  # a bug caught by a receive loop's boundary (logged)
    # gateway (HTTP) only
    REQUEST_TOO_LARGE = "request_too_large"  # body over --max-body-bytes (HTTP 413)


# Error text quotes client data through `short_repr` only: a value nested 1,000 deep or 60 MB
# long must neither raise (RecursionError) nor blow a reply or a log line up.
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
MAX_QUOTE_CHARS = 120


def short_repr(value: object) -> str:
    """repr() of client data, bounded in depth and length (at most MAX_QUOTE_CHARS chars)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ is impossible for msgpack values,
        text = f"<{type(value).__name__}>"  # but the quote must never fail
    return text if len(text) <= MAX_QUOTE_CHARS else text[: MAX_QUOTE_CHARS - 3] + "..."
