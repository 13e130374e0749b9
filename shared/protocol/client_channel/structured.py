"""The structured-output keys of a `generate`'s `params` (docs/protocol.md): at most one of
`json_schema`, `json_object`, `regex`, `grammar`, `choice`, and `logit_bias`; and the tool
fields of a chat (`tools`, a message's `tool_calls` and `tool_call_id`).

Their shapes are checked here (`invalid_params`); whether the constraint compiles is the
frontend's admission (shared/constraints.py: `invalid_constraint`, `constraint_too_large`,
`constraint_too_slow`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from shared.protocol.client_channel.messages import ClientMessageError
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import Constraint

CONSTRAINT_PARAMS = ("json_schema", "json_object", "regex", "grammar", "choice")
STRUCTURED_PARAMS = (*CONSTRAINT_PARAMS, "logit_bias")
MAX_CHOICES = 1024
MAX_TOOLS = 128


def structured_kwargs(params: dict, rid: Optional[str]) -> dict[str, Any]:
    """SamplingParams keyword arguments (`constraint`, `logit_bias`) from `params`."""
    out: dict[str, Any] = {}
    given = [k for k in CONSTRAINT_PARAMS if params.get(k) not in (None, False)]
    if len(given) > 1:
        _fail(f"give at most one of {', '.join(CONSTRAINT_PARAMS)} (got {', '.join(given)})", rid)
    if given:
        out["constraint"] = _constraint(given[0], params[given[0]], rid)
    if params.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(params["logit_bias"], rid)
    return out


def _constraint(kind: str, value: Any, rid: Optional[str]) -> Constraint:
    if kind == "json_schema":
        return Constraint(kind, _schema_text(value, rid))
    if kind == "json_object":
        if value is not True:
            _fail("json_object must be true or false", rid)
        return Constraint(kind)
    if kind == "choice":
        ok = isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in value):
            _fail(f"choice must be a list of 1-{MAX_CHOICES} non-empty strings", rid)
        return Constraint(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        _fail(f"{kind} must be a non-empty string", rid)
    return Constraint(kind, value)


def _schema_text(value: Any, rid: Optional[str]) -> str:
    """A schema map, or its JSON text, as compact JSON text (the cache key: key order kept, it
    is the order the properties are written in)."""
    try:
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            _fail("json_schema must be a map (or its JSON text) holding a JSON schema", rid)
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        _fail(f"json_schema is not JSON: {str(exc)[:120]}", rid)
    raise AssertionError("unreachable")


def _logit_bias(value: Any, rid: Optional[str]) -> dict[str, float]:
    """A map of token id (an integer, or its decimal text as in OpenAI's JSON) -> number."""
    if not isinstance(value, dict):
        _fail("logit_bias must be a map of token id -> bias", rid)
    out: dict[str, float] = {}
    for key, bias in value.items():
        token = str(key) if type(key) is int and key >= 0 else key
        if type(bias) not in (int, float) or not isinstance(token, str):
            _fail("logit_bias maps token ids (integers or decimal strings) to numbers", rid)
        out[token] = bias  # its range: SamplingParams
    return out


def _fail(message: str, rid: Optional[str]) -> None:
    raise ClientMessageError(ErrorCode.INVALID_PARAMS, message, rid)


def tools_list(value: Any, rid: Optional[str]) -> Optional[list[dict[str, Any]]]:
    """`generate`'s `tools`: nil, or a list of {"type": "function", "function": {"name": str,
    "description"?: str, "parameters"?: map}} (rendered into the prompt by the chat template)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise _prompt_error(f"`tools` must be a list of 1-{MAX_TOOLS} function tools", rid)
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        ok = isinstance(fn, dict) and tool.get("type", "function") == "function"
        if not ok or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _prompt_error(f"tools[{i}] must be {{type: function, function: {{name}}}}", rid)
        if not isinstance(fn.get("parameters", {}), dict):
            raise _prompt_error(f"tools[{i}].function.parameters must be a map", rid)
    return value


def tool_message_fields(item: dict, i: int, rid: Optional[str]) -> dict[str, Any]:
    """A chat message's `tool_calls` (an assistant's) and `tool_call_id` (a tool's result)."""
    out: dict[str, Any] = {}
    calls = item.get("tool_calls")
    if calls is not None:
        ok = isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str) for c in calls
        )  # fmt: skip
        if not ok:
            raise _prompt_error(
                f"messages[{i}].tool_calls must be calls {{function: {{name}}}}", rid
            )
        out["tool_calls"] = calls
    call_id = item.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise _prompt_error(f"messages[{i}].tool_call_id must be a string", rid)
        out["tool_call_id"] = call_id
    return out


def _prompt_error(message: str, rid: Optional[str]) -> ClientMessageError:
    return ClientMessageError(ErrorCode.INVALID_PROMPT, message, rid)
