"""Structured outputs and tools on the OpenAI surface -> the engine's constraint parameters.

At most one constraint per request, from: `response_format` (`json_object`; `json_schema`,
enforced whatever its `strict` says), vLLM's `guided_json` / `guided_regex` / `guided_grammar`
(Lark, or GBNF: converted) / `guided_choice`, or `tool_choice` `required` / a named function
(a grammar whose every sentence is a call of an offered function with valid arguments:
shared/tool_calls.py). `tool_choice` `auto` (the default with tools) leaves the reply free and
parses it; `none` sends no tools. `logit_bias` passes through. Whether a schema compiles is the
engine's answer (400 `invalid_constraint` naming the unsupported feature, and so on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.errors import ApiError, invalid_param
from shared import tool_calls as tc


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              populate_by_name=True)  # fmt: skip


class JsonSchemaFormat(_Loose):
    name: str = "response"
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDef(_Loose):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolDef(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class _Named(_Loose):
    name: str


class NamedToolChoice(_Loose):
    type: Literal["function"] = "function"
    function: _Named


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class StructuredFields(_Loose):
    """Both endpoints' structured-output fields (vLLM's guided_* included)."""

    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    logit_bias: Optional[dict[str, Union[int, float]]] = None


@dataclass(frozen=True, slots=True)
class ToolMode:
    """A chat whose reply is parsed for calls (auto) or is only calls (forced)."""

    forced: bool


def structured_kwargs(
    req: StructuredFields,
    tools: Optional[list[ToolDef]] = None,
    tool_choice: Optional[ToolChoice] = None,
    parallel_tool_calls: bool = True,
) -> tuple[dict[str, Any], Optional[ToolMode]] | ApiError:
    """The engine parameters (a constraint, logit_bias, tools) and how to read the reply."""
    kwargs: dict[str, Any] = {}
    if req.logit_bias:
        kwargs["logit_bias"] = dict(req.logit_bias)
    given = _constraints(req)
    if isinstance(given, ApiError):
        return given
    mode: Optional[ToolMode] = None
    if tools:
        choice = tool_choice if tool_choice is not None else "auto"
        forced = _forced_grammar(tools, choice, parallel_tool_calls)
        if isinstance(forced, ApiError):
            return forced
        if forced is not None:
            given.append(("tool_choice", {"grammar": forced}))
        if choice != "none":
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
            mode = ToolMode(forced=forced is not None)
    elif tool_choice not in (None, "none"):
        return invalid_param("tool_choice", "tool_choice needs tools")
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        return invalid_param(given[1][0], f"give at most one output constraint (got {names})")
    for _, params in given:
        kwargs.update(params)
    return kwargs, mode


def _constraints(req: StructuredFields) -> list[tuple[str, dict[str, Any]]] | ApiError:
    out: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            return invalid_param("response_format", "json_schema needs response_format.json_schema")
        out.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return invalid_param("guided_json", "guided_json is not JSON")
        out.append(("guided_json", {"json_schema": schema}))
    for name, key in (("guided_regex", "regex"), ("guided_grammar", "grammar"),
                      ("guided_choice", "choice")):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            out.append((name, {key: value}))
    return out


def _forced_grammar(
    tools: list[ToolDef], choice: ToolChoice, parallel: bool
) -> Optional[str] | ApiError:
    """The grammar of `required` / a named function; None for `auto` and `none`."""
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    if choice == "required":
        return tc.call_grammar(functions, parallel)
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            return invalid_param("tool_choice", f"no tool is named {choice.function.name!r}")
        return tc.call_grammar(named, parallel=False)
    return None
