"""Stable error codes (snake_case strings). Clients match on these; never rename one.

The table with meanings lives in docs/protocol.md.
"""


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
    DUPLICATE_ID = "duplicate_id"  # id already in flight on this connection
    # engine state
    NOT_READY = "not_ready"  # no worker handshake yet (or worker lost)
    OVERLOADED = "overloaded"  # waiting queue full
    WORKER_FAILED = "worker_failed"  # the worker died or failed the step
    SHUTTING_DOWN = "shutting_down"  # draining: no new requests
    ENGINE_UNREACHABLE = "engine_unreachable"  # scheduler lost, or a client's timeout expired
    INTERNAL = "internal_error"
