"""OpenAI request bodies, validated, and their translation into engine calls.

pydantic checks types and ranges (FastAPI turns its errors into 400s, see errors.py); `plan_*`
then checks what depends on the gateway's settings or on several fields at once and returns
either an `EngineCallPlan` or an `ApiError` (a value, not an exception, so callers branch on it).
Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send `user` or
`store` still work; fields we cannot honour (echo, suffix) are refused. Structured outputs and
tools: structured.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.errors import ApiError, invalid_param
from services.gateway.structured import (
    StructuredFields,
    ToolChoice,
    ToolDef,
    ToolMode,
    structured_kwargs,
)
from shared.protocol.client_channel import MAX_STOP_CHARS, MAX_STOP_STRINGS
from shared.protocol.sampling import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

SEED_MODULUS = 2**63  # derived seeds stay within a signed 64-bit integer

# (role in the request, role given to the chat template)
CHAT_ROLES: dict[str, str] = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system role
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",  # a tool's result (the chat template renders it)
}


# Every integer fits a signed 64-bit integer (what the engine's msgpack frames carry); every
# float is finite (NaN and Infinity, which Python's JSON parser accepts as literals, are 400s).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Body(BaseModel):
    """Strict types (no "5" for 5, no true for 1), finite floats; unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(StructuredFields):
    """The parameters both endpoints share. None means: the engine's default."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1, le=INT64_MAX)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(
        default=None, ge=-1, le=INT64_MAX
    )  # -1 and 0 disable it (vLLM's convention)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None  # checked in _common_problem
    stop_token_ids: Optional[list[TokenId]] = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    priority: Int64 = 0
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    best_of: Optional[Int64] = None
    # Conveyor extensions (docs/gateway.md, "Latency targets"): checked by the engine's frontend
    slo_class: Optional[str] = None
    ttft_ms: Optional[float] = Field(default=None, gt=0.0)
    tpot_ms: Optional[float] = Field(default=None, gt=0.0)
    on_slo_miss: Optional[Literal["reject", "best_effort"]] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]  # ids checked in _split_prompts
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool's result: the call it answers


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One engine request: the keyword arguments of `AsyncClient.stream` for one choice."""

    index: int  # choice index in the response
    prompt_index: int  # which prompt of a batched completion it answers
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EngineCallPlan:
    """Everything a route needs to run one validated request and shape its answer."""

    calls: list[EngineCall]
    stream: bool
    include_usage: bool
    num_logprobs: Optional[int]  # None: the response carries no logprobs
    tool_mode: Optional[ToolMode] = None  # a chat with tools: its reply is read for calls


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """What `plan_*` checks against; from the gateway's settings."""

    served_model_name: str
    max_choices: int  # prompts x n, across one HTTP request
    default_max_tokens: Optional[int]  # None: the engine's own default


def plan_completion(req: CompletionRequest, limits: GatewayLimits) -> EngineCallPlan | ApiError:
    """Called once per POST /v1/completions after pydantic validation."""
    problem = _common_problem(req, limits)
    if problem is None and req.echo:
        problem = invalid_param("echo", "echo is not supported")
    if problem is None and req.suffix is not None:
        problem = invalid_param("suffix", "suffix is not supported")
    prompts, problem = _split_prompts(req.prompt) if problem is None else ([], problem)
    if problem is None and len(prompts) * req.n > limits.max_choices:
        problem = _too_many_choices(len(prompts), req.n, limits)
    structured = structured_kwargs(req) if problem is None else problem
    if isinstance(structured, ApiError):
        return structured
    base = {**_sampling_kwargs(req, req.max_tokens, limits), **structured[0]}
    if req.logprobs is not None:
        base["logprobs"] = req.logprobs
    calls: list[EngineCall] = []
    for p_index, prompt in enumerate(prompts):
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        for j in range(req.n):
            kwargs = {**base, key: prompt, **_choice_seed(req.seed, j)}
            calls.append(EngineCall(index=len(calls), prompt_index=p_index, kwargs=kwargs))
    return EngineCallPlan(calls, req.stream, _include_usage(req), req.logprobs)


def plan_chat(req: ChatRequest, limits: GatewayLimits) -> EngineCallPlan | ApiError:
    """Called once per POST /v1/chat/completions after pydantic validation."""
    problem = _common_problem(req, limits)
    if problem is None and req.top_logprobs is not None and not req.logprobs:
        problem = invalid_param("top_logprobs", "top_logprobs needs logprobs set to true")
    if problem is None and req.n > limits.max_choices:
        problem = _too_many_choices(1, req.n, limits)
    messages, problem = _chat_messages(req.messages) if problem is None else ([], problem)
    structured = (
        structured_kwargs(req, req.tools, req.tool_choice, req.parallel_tool_calls)
        if problem is None
        else problem
    )
    if isinstance(structured, ApiError):
        return structured
    max_tokens = req.max_completion_tokens if req.max_completion_tokens else req.max_tokens
    base = {**_sampling_kwargs(req, max_tokens, limits), **structured[0]}
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if num_logprobs is not None:
        base["logprobs"] = num_logprobs
    calls = [
        EngineCall(
            index=j,
            prompt_index=0,
            kwargs={**base, "messages": messages, **_choice_seed(req.seed, j)},
        )
        for j in range(req.n)
    ]
    return EngineCallPlan(calls, req.stream, _include_usage(req), num_logprobs, structured[1])


def _common_problem(req: _SamplingFields, limits: GatewayLimits) -> Optional[ApiError]:
    if req.model is not None and req.model != limits.served_model_name:
        return ApiError(
            404,
            f"The model '{req.model}' does not exist",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    if req.stream_options is not None and not req.stream:
        return invalid_param("stream_options", "stream_options is only allowed with stream=true")
    if req.best_of is not None and req.best_of != req.n:
        return invalid_param("best_of", "best_of other than n is not supported")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        message = (
            f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings "
            f"of 1-{MAX_STOP_CHARS} characters"
        )
        return invalid_param("stop", message)
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        return invalid_param("stop_token_ids", "stop_token_ids must be non-negative integers")
    return None


def _split_prompts(
    prompt: Union[str, list[str], list[int], list[list[int]]],
) -> tuple[list[Union[str, list[int]]], Optional[ApiError]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompts: list[Union[str, list[int]]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        return [], invalid_param("prompt", "prompt must not be empty")
    if any(isinstance(p, list) and any(not 0 <= t <= INT64_MAX for t in p) for p in prompts):
        return [], invalid_param("prompt", "prompt token ids must be in [0, 2^63)")
    return prompts, None


def _chat_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], Optional[ApiError]]:
    """Chat messages -> the client protocol's {"role", "content"} maps (text parts joined;
    an assistant's `tool_calls` and a tool result's `tool_call_id` kept)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            allowed = ", ".join(CHAT_ROLES)
            return [], invalid_param(f"messages[{i}].role", f"role must be one of: {allowed}")
        if isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        item: dict[str, Any] = {"role": role, "content": content}
        if m.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out, None


def _sampling_kwargs(
    req: _SamplingFields, max_tokens: Optional[int], limits: GatewayLimits
) -> dict[str, Any]:
    """Only the parameters the client set, so the engine's defaults apply to the rest."""
    kwargs: dict[str, Any] = {"priority": req.priority}
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    optional = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k if req.top_k is None or req.top_k >= 1 else None,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "stop_token_ids": req.stop_token_ids,
        "slo_class": req.slo_class,
        "ttft_ms": req.ttft_ms,
        "tpot_ms": req.tpot_ms,
        "on_slo_miss": req.on_slo_miss,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def _choice_seed(seed: Optional[int], j: int) -> dict[str, int]:
    """Choice j of n gets seed + j, so n > 1 with a seed gives n different but repeatable draws.

    Without a seed the engine derives one from each request's own id, which already differs.
    """
    if seed is None:
        return {}
    return {"seed": (seed + j) % SEED_MODULUS}


def _include_usage(req: _SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _too_many_choices(num_prompts: int, n: int, limits: GatewayLimits) -> ApiError:
    return invalid_param(
        "n",
        f"{num_prompts} prompt(s) x n={n} exceeds the gateway's limit of "
        f"{limits.max_choices} choices per request",
    )
