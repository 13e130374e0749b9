"""The client protocol (docs/protocol.md): client maps -> typed requests, and reply frames.

Clients in any language write these maps by hand, so nothing here trusts a field: every type,
range and size is checked, and a problem becomes a `ClientMessageError` with a stable code (and
the message's `id` when it had a readable one) that the frontend turns into an `error` reply.
Replies are built here too, so the frontend and the tests agree on one wire shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgpack

from shared.protocol.codec import DecodeError
from shared.protocol.errors import ErrorCode, short_repr
from shared.protocol.sampling import INT64_MAX, INT64_MIN, MAX_STOP_TOKEN_IDS, SamplingParams
from shared.protocol.worker_channel import TokenLogprobs

PROTOCOL_VERSION = 1
MAX_ID_BYTES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
DEFAULT_MAX_FRAME_BYTES = 1 << 20
CLIENT_MESSAGE_TYPES = ("generate", "abort", "health", "stats", "reset_prefix_cache")

_INT, _NUM, _BOOL = "int", "number", "bool"
# params key -> (wire type, may be nil). Defaults live in SamplingParams.
_PARAM_TYPES: dict[str, tuple[str, bool]] = {
    "max_tokens": (_INT, False),
    "temperature": (_NUM, False),
    "top_p": (_NUM, False),
    "top_k": (_INT, True),
    "min_p": (_NUM, False),
    "seed": (_INT, True),
    "ignore_eos": (_BOOL, False),
    "logprobs": (_INT, True),
    "repetition_penalty": (_NUM, False),
    "presence_penalty": (_NUM, False),
    "frequency_penalty": (_NUM, False),
}
PARAM_NAMES = (*_PARAM_TYPES, "stop", "stop_token_ids")


class ClientMessageError(DecodeError):
    """A client frame that cannot be served; `id` is the message's id when it had one."""

    def __init__(self, code: str, message: str, id: Optional[str] = None) -> None:
        super().__init__(code, message)
        self.id = id


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateCommand:
    """A validated `generate`: exactly one of prompt / messages / prompt_token_ids is set."""

    id: str
    sampling: SamplingParams
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    prompt_token_ids: Optional[list[int]] = None
    stop: list[str] = field(default_factory=list)  # stop strings, applied by the frontend
    stream: bool = False
    priority: int = 0
    add_generation_prompt: bool = True


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


ClientCommand = Union[
    GenerateCommand, AbortCommand, HealthCommand, StatsCommand, ResetPrefixCacheCommand
]


# ---- client -> frontend ----------------------------------------------------------------------


def decode_client_message(frame: bytes, max_size: int = DEFAULT_MAX_FRAME_BYTES) -> ClientCommand:
    """Parse one client frame, checking in the documented order; raise ClientMessageError."""
    if len(frame) > max_size:
        raise ClientMessageError(
            ErrorCode.FRAME_TOO_LARGE,
            f"frame of {len(frame)} bytes > limit {max_size}",
            peek_id(frame),
        )
    try:
        wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ClientMessageError(
            ErrorCode.MALFORMED_MESSAGE, f"not msgpack: {short_repr(str(exc))}"
        ) from None
    if not isinstance(wire, dict):
        raise ClientMessageError(ErrorCode.MALFORMED_MESSAGE, "a message must be a msgpack map")
    raw_id = wire.get("id")
    reply_id = raw_id if isinstance(raw_id, str) and _id_ok(raw_id) else None
    kind = wire.get("type")
    if not isinstance(kind, str) or kind not in CLIENT_MESSAGE_TYPES:
        msg = f"unknown message type {short_repr(kind)}"
        raise ClientMessageError(ErrorCode.UNKNOWN_TYPE, msg, reply_id)
    version = wire.get("v")
    if type(version) is not int:
        raise ClientMessageError(ErrorCode.INVALID_FIELD, "`v` must be the integer 1", reply_id)
    if version != PROTOCOL_VERSION:
        msg = f"protocol version {version} not supported (this frontend speaks 1)"
        raise ClientMessageError(ErrorCode.UNSUPPORTED_VERSION, msg, reply_id)
    if kind == "generate":
        return _generate(wire, _required_id(wire))
    if kind == "abort":
        return AbortCommand(_required_id(wire))
    optional_id = _optional_id(wire)
    if kind == "reset_prefix_cache":
        return ResetPrefixCacheCommand(optional_id)
    return HealthCommand(optional_id) if kind == "health" else StatsCommand(optional_id)


def peek_id(frame: bytes) -> Optional[str]:
    """The `id` of a map frame too large to decode whole, read by skipping every other value
    (no copy of the big prompt); None when there is no readable one."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(frame))
    try:
        unpacker.feed(frame)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key != "id":
                unpacker.skip()
                continue
            value = unpacker.unpack()
            return value if isinstance(value, str) and _id_ok(value) else None
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types; no id then
        return None
    return None


def _id_ok(value: str) -> bool:
    return 0 < len(value.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES


def _required_id(wire: dict) -> str:
    value = wire.get("id")
    if not isinstance(value, str) or not _id_ok(value):
        raise ClientMessageError(
            ErrorCode.INVALID_FIELD, f"`id` must be a string of 1-{MAX_ID_BYTES} bytes"
        )
    return value


def _optional_id(wire: dict) -> Optional[str]:
    return None if wire.get("id") is None else _required_id(wire)


def _field(wire: dict, name: str, kind: type, default: Any, rid: str) -> Any:
    value = wire.get(name)
    if value is None:
        return default
    if type(value) is not kind or (kind is int and not INT64_MIN <= value <= INT64_MAX):
        what = "a signed 64-bit integer" if kind is int else kind.__name__
        raise ClientMessageError(ErrorCode.INVALID_FIELD, f"`{name}` must be {what}", rid)
    return value


def _generate(wire: dict, rid: str) -> GenerateCommand:
    stream = _field(wire, "stream", bool, False, rid)
    priority = _field(wire, "priority", int, 0, rid)
    add_gen = _field(wire, "add_generation_prompt", bool, True, rid)
    params = _field(wire, "params", dict, {}, rid)
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if wire.get(k) is not None]
    if len(given) != 1:
        raise ClientMessageError(
            ErrorCode.INVALID_PROMPT,
            "give exactly one of prompt, messages, prompt_token_ids "
            f"(got {', '.join(given) or 'none'})",
            rid,
        )
    prompt = messages = token_ids = None
    if given[0] == "prompt":
        prompt = _prompt_text(wire["prompt"], rid)
    elif given[0] == "messages":
        messages = _chat_messages(wire["messages"], rid)
    else:
        token_ids = _token_ids(wire["prompt_token_ids"], rid)
    sampling, stop = parse_params(params, rid)
    return GenerateCommand(
        id=rid,
        sampling=sampling,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        stop=stop,
        stream=stream,
        priority=priority,
        add_generation_prompt=add_gen,
    )


def _prompt_text(value: Any, rid: str) -> str:
    if not isinstance(value, str):
        raise ClientMessageError(ErrorCode.INVALID_FIELD, "`prompt` must be a string", rid)
    if not value:
        raise ClientMessageError(ErrorCode.INVALID_PROMPT, "`prompt` is empty", rid)
    return value


def _token_ids(value: Any, rid: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        msg = "`prompt_token_ids` must be a list of integers"
        raise ClientMessageError(ErrorCode.INVALID_FIELD, msg, rid)
    if not value:
        raise ClientMessageError(ErrorCode.INVALID_PROMPT, "`prompt_token_ids` is empty", rid)
    return value


def _chat_messages(value: Any, rid: str) -> list[ChatMessage]:
    if not isinstance(value, list):
        raise ClientMessageError(ErrorCode.INVALID_FIELD, "`messages` must be a list", rid)
    if not value:
        raise ClientMessageError(ErrorCode.INVALID_PROMPT, "`messages` is empty", rid)
    out = []
    for i, item in enumerate(value):
        role = item.get("role") if isinstance(item, dict) else None
        content = _content_text(item.get("content")) if isinstance(item, dict) else None
        if not isinstance(role, str) or not role or content is None:
            msg = f"messages[{i}] must be a map with a `role` string and a `content` text"
            raise ClientMessageError(ErrorCode.INVALID_PROMPT, msg, rid)
        out.append(ChatMessage(role, content))
    return out


def _content_text(content: Any) -> Optional[str]:
    """A message's content as text: a str, or a list of {"type": "text", "text": str} parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        ok = isinstance(part, dict) and part.get("type") == "text"
        if not ok or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return "".join(texts)


def parse_params(params: dict, rid: Optional[str] = None) -> tuple[SamplingParams, list[str]]:
    """`params` map -> (SamplingParams, stop strings); any problem is `invalid_params`."""
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in PARAM_NAMES:
            msg = f"unknown parameter {short_repr(key)}"
            raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
        if value is None or key == "stop":
            continue
        if key == "stop_token_ids":
            if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
                msg = f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} integers"
                raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
            if not all(type(t) is int for t in value):
                msg = "stop_token_ids must be a list of integers"
                raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
        elif not _has_type(value, _PARAM_TYPES[key][0]):
            kind = _PARAM_TYPES[key][0]
            raise ClientMessageError(ErrorCode.INVALID_PARAMS, f"{key} must be {kind}", rid)
        kwargs[key] = value
    stop = _stop_strings(params.get("stop"), rid)
    try:
        sampling = SamplingParams(**kwargs)
    except ValueError as exc:
        raise ClientMessageError(ErrorCode.INVALID_PARAMS, str(exc), rid) from None
    return sampling, stop


def _has_type(value: Any, kind: str) -> bool:
    if kind == _BOOL:
        return type(value) is bool
    if kind == _INT:
        return type(value) is int
    return type(value) in (int, float)


def _stop_strings(value: Any, rid: Optional[str]) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    ok = isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS
    if not ok or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        msg = (
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings "
            f"of 1-{MAX_STOP_CHARS} characters"
        )
        raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
    return list(stops)


# ---- frontend -> client ----------------------------------------------------------------------


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


# ---- client side -----------------------------------------------------------------------------


def encode_client_message(kind: str, id: Optional[str], **fields: Any) -> bytes:
    """A client message frame (used by shared/client); nil fields are left out."""
    present = {k: v for k, v in fields.items() if v is not None}
    wire = {"type": kind, "v": PROTOCOL_VERSION, **present}
    if id is not None:
        wire["id"] = id
    return msgpack.packb(wire, use_bin_type=True)


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A frontend reply as a map; DecodeError when it is not one (a foreign peer)."""
    try:
        wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(
            ErrorCode.MALFORMED_MESSAGE, f"reply is not msgpack: {short_repr(str(exc))}"
        ) from None
    if not isinstance(wire, dict) or not isinstance(wire.get("type"), str):
        raise DecodeError(ErrorCode.MALFORMED_MESSAGE, "reply is not a map with a type")
    return wire
