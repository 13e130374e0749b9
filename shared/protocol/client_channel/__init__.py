"""The client protocol (docs/protocol.md): client maps -> typed commands, and reply frames.

One channel, one package, split by concern:

* `messages.py`: the version, limits and typed commands (frozen dataclasses);
* `validate.py`: a client frame -> a command, every field checked (ClientMessageError);
* `replies.py`: every frame the frontend sends a client;
* `client_frames.py`: what a client sends, and a reply read back as a map.

Importers use the channel as one module (`from shared.protocol import client_channel as cc`);
the names below are its interface.
"""

from shared.protocol.client_channel.client_frames import decode_reply, encode_client_message
from shared.protocol.client_channel.messages import (
    CLIENT_MESSAGE_TYPES,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_ID_BYTES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    PROTOCOL_VERSION,
    AbortCommand,
    ChatMessage,
    ClientCommand,
    ClientMessageError,
    DrainCommand,
    GenerateCommand,
    HealthCommand,
    ResetPrefixCacheCommand,
    StatsCommand,
)
from shared.protocol.client_channel.replies import (
    Timings,
    Usage,
    aborted_reply,
    chunk_reply,
    done_reply,
    drain_reply,
    embedding_reply,
    encode_reply,
    error_reply,
    health_reply,
    heartbeat_reply,
    logprobs_to_wire,
    reset_prefix_cache_reply,
    stats_reply,
)
from shared.protocol.client_channel.validate import (
    PARAM_NAMES,
    decode_client_message,
    parse_params,
    peek_id,
)

__all__ = [
    "CLIENT_MESSAGE_TYPES",
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_ID_BYTES",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "PARAM_NAMES",
    "PROTOCOL_VERSION",
    "AbortCommand",
    "ChatMessage",
    "ClientCommand",
    "ClientMessageError",
    "DrainCommand",
    "GenerateCommand",
    "HealthCommand",
    "ResetPrefixCacheCommand",
    "StatsCommand",
    "Timings",
    "Usage",
    "aborted_reply",
    "chunk_reply",
    "decode_client_message",
    "decode_reply",
    "done_reply",
    "drain_reply",
    "embedding_reply",
    "encode_client_message",
    "encode_reply",
    "error_reply",
    "health_reply",
    "heartbeat_reply",
    "logprobs_to_wire",
    "parse_params",
    "peek_id",
    "reset_prefix_cache_reply",
    "stats_reply",
]
