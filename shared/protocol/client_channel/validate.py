"""Client frames -> typed commands (shared/protocol/client_channel/messages.py).

Clients in any language write these maps by hand, so nothing here trusts a field: every type,
range and size is checked, and a problem becomes a `ClientMessageError` with a stable code (and
the message's `id` when it had a readable one) that the frontend turns into an `error` reply.
Called by the frontend on each client frame (`decode_client_message`) and by the gateway when it
checks OpenAI parameters (`parse_params`).
"""

from __future__ import annotations

from typing import Any, Optional

import msgpack

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
from shared.protocol.client_channel.structured import (
    STRUCTURED_PARAMS,
    structured_kwargs,
    tool_message_fields,
    tools_list,
)
from shared.protocol.client_channel.targets import latency_targets
from shared.protocol.errors import ErrorCode, short_repr
from shared.protocol.sampling import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_TOKEN_IDS,
    POOLING_KINDS,
    SamplingParams,
)
from shared.tracing import valid_traceparent

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
PARAM_NAMES = (*_PARAM_TYPES, "stop", "stop_token_ids", *STRUCTURED_PARAMS)


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
    if kind == "embed":
        return _embed(wire, _required_id(wire))
    if kind == "abort":
        return AbortCommand(_required_id(wire))
    optional_id = _optional_id(wire)
    if kind == "drain":
        return _drain(wire, optional_id)
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
    tools = tools_list(wire.get("tools"), rid)
    resume_ids, resume_text = _resume(wire.get("resume"), rid)
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
        tools=tools,
        resume_token_ids=resume_ids,
        resume_text=resume_text,
        traceparent=valid_traceparent(wire.get("traceparent")),
        targets=latency_targets(wire, rid),
    )


def _embed(wire: dict, rid: str) -> GenerateCommand:
    """An `embed`: a prefill-only request whose one sampled token is discarded (greedy, past
    end-of-sequence) and whose reply is the pooled hidden state (services/worker/pooling.py)."""
    priority = _field(wire, "priority", int, 0, rid)
    pooling = _field(wire, "pooling", str, "last", rid)
    if pooling not in POOLING_KINDS:
        msg = f"`pooling` must be one of {', '.join(POOLING_KINDS)}, not {short_repr(pooling)}"
        raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
    given = [k for k in ("prompt", "prompt_token_ids") if wire.get(k) is not None]
    if len(given) != 1:
        msg = f"give exactly one of prompt, prompt_token_ids (got {', '.join(given) or 'none'})"
        raise ClientMessageError(ErrorCode.INVALID_PROMPT, msg, rid)
    text = _prompt_text(wire["prompt"], rid) if given[0] == "prompt" else None
    ids = _token_ids(wire["prompt_token_ids"], rid) if text is None else None
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=pooling)
    trace = valid_traceparent(wire.get("traceparent"))
    return GenerateCommand(rid, sampling, prompt=text, prompt_token_ids=ids, priority=priority,
                           traceparent=trace)  # fmt: skip


def _resume(value: Any, rid: str) -> tuple[Optional[list[int]], str]:
    """`resume`: nil, or {"token_ids": [int], "text": str} (what a resuming client has)."""
    if value is None:
        return None, ""
    ids = value.get("token_ids") if isinstance(value, dict) else None
    text = (value.get("text") or "") if isinstance(value, dict) else None
    ok_ids = isinstance(ids, list) and all(type(t) is int for t in ids)
    if not ok_ids or not isinstance(text, str) or set(value) - {"token_ids", "text"}:
        msg = "`resume` must be a map with `token_ids` (a list of integers) and `text`"
        raise ClientMessageError(ErrorCode.INVALID_FIELD, msg, rid)
    return ids, text


def _drain(wire: dict, optional_id: Optional[str]) -> DrainCommand:
    engine = wire.get("engine")
    drain = True if wire.get("drain") is None else wire["drain"]
    if not isinstance(engine, str) or not engine or type(drain) is not bool:
        msg = "`drain` needs `engine` (a name, as in health) and `drain` (a bool)"
        raise ClientMessageError(ErrorCode.INVALID_FIELD, msg, optional_id)
    return DrainCommand(engine, drain, optional_id)


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
        if content is None and isinstance(item, dict) and item.get("tool_calls"):
            content = "" if item.get("content") is None else None  # calls without text
        if not isinstance(role, str) or not role or content is None:
            msg = f"messages[{i}] must be a map with a `role` string and a `content` text"
            raise ClientMessageError(ErrorCode.INVALID_PROMPT, msg, rid)
        out.append(ChatMessage(role, content, **tool_message_fields(item, i, rid)))
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
        if value is None or key == "stop" or key in STRUCTURED_PARAMS:
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
    kwargs.update(structured_kwargs(params, rid))
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
