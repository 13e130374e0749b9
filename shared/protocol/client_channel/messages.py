"""The client channel's messages (docs/protocol.md): its version, limits, the typed commands a
validated client frame becomes, and the error a frame that cannot be served raises.

Frozen slotted dataclasses; built only by `validate.decode_client_message`, read by the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from shared.protocol.codec import DecodeError
from shared.protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1
MAX_ID_BYTES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
DEFAULT_MAX_FRAME_BYTES = 1 << 20
CLIENT_MESSAGE_TYPES = ("generate", "embed", "abort", "health", "stats", "reset_prefix_cache",
                        "drain")  # fmt: skip


class ClientMessageError(DecodeError):
    """A client frame that cannot be served; `id` is the message's id when it had one."""

    def __init__(self, code: str, message: str, id: Optional[str] = None) -> None:
        super().__init__(code, message)
        self.id = id


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    # an assistant's calls, OpenAI's shape ({"id", "type", "function": {"name", "arguments"}})
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None  # a "tool" message: the call it answers


@dataclass(frozen=True, slots=True)
class LatencyTargets:
    """A request's latency targets (targets.py parses them; docs/protocol.md)."""

    slo_class: Optional[str] = None
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    on_slo_miss: Optional[str] = None  # None: the class's choice, else "best_effort"


NO_TARGETS = LatencyTargets()


@dataclass(frozen=True, slots=True)
class GenerateCommand:
    """A validated `generate`: exactly one of prompt / messages / prompt_token_ids is set. An
    `embed` is one too: its sampling names a pooling (answered with `embedding`)."""

    id: str
    sampling: SamplingParams
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    prompt_token_ids: Optional[list[int]] = None
    stop: list[str] = field(default_factory=list)  # stop strings, applied by the frontend
    stream: bool = False
    priority: int = 0
    add_generation_prompt: bool = True
    tools: Optional[list[dict[str, Any]]] = None  # OpenAI's {"type": "function", "function"}
    # `resume`: a stream the client resumes here (its frontend was lost): the token ids and
    # the text it received; None: a new request
    resume_token_ids: Optional[list[int]] = None
    resume_text: str = ""
    traceparent: Optional[str] = None  # W3C trace context of the client's span (tracing)
    targets: LatencyTargets = NO_TARGETS


@dataclass(frozen=True, slots=True)
class AbortCommand:
    id: str


@dataclass(frozen=True, slots=True)
class HealthCommand:
    id: Optional[str] = None


@dataclass(frozen=True, slots=True)
class StatsCommand:
    id: Optional[str] = None


@dataclass(frozen=True, slots=True)
class ResetPrefixCacheCommand:
    """Empty the engine's prefix cache; answered with the number of blocks dropped."""

    id: Optional[str] = None


@dataclass(frozen=True, slots=True)
class DrainCommand:
    """Maintenance: stop (`drain` True) or start again (False) admitting to one engine."""

    engine: str  # the engine's name ("0", "1", ...: as in `health`)
    drain: bool = True
    id: Optional[str] = None


ClientCommand = Union[
    GenerateCommand,
    AbortCommand,
    HealthCommand,
    StatsCommand,
    ResetPrefixCacheCommand,
    DrainCommand,
]
