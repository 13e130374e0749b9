"""The gateway's request validation and its OpenAI-shaped errors (no engine needed).

Requests that fail validation never reach the engine, so the HTTP checks here run the real app
with nothing listening at its engine address. Runtime: ~3 s idle (11 s on a busy machine).
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, from_engine_error, from_validation_errors
from services.gateway.openai_schema import (
    ChatRequest,
    CompletionRequest,
    EngineCallPlan,
    GatewayLimits,
    plan_chat,
    plan_completion,
)
from shared.logging import configure_logging
from shared.protocol.client_channel import PARAM_NAMES, parse_params

LIMITS = GatewayLimits(served_model_name="smollm2", max_choices=8, default_max_tokens=None)
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


def completion(**body: Any) -> EngineCallPlan | ApiError:
    return plan_completion(CompletionRequest.model_validate(body), LIMITS)


def chat(**body: Any) -> EngineCallPlan | ApiError:
    return plan_chat(ChatRequest.model_validate(body), LIMITS)


def ok(result: EngineCallPlan | ApiError) -> EngineCallPlan:
    assert isinstance(result, EngineCallPlan), result
    for call in result.calls:
        # What we send must pass the engine's own parameter check (the real protocol code).
        params = {k: v for k, v in call.kwargs.items() if k in PARAM_NAMES}
        parse_params(params)
        assert set(call.kwargs) <= {*PARAM_NAMES, *PROMPT_KEYS, "priority"}
    return result


def rejected(body: dict[str, Any], model: type = CompletionRequest) -> ApiError:
    """The 400 a body gets, whether pydantic or the planner refuses it."""
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        return from_validation_errors(exc.errors())
    result = (plan_completion if model is CompletionRequest else plan_chat)(req, LIMITS)
    assert isinstance(result, ApiError), f"{body} was accepted"
    return result


# ---- translation into engine calls -----------------------------------------------------------


def test_only_given_parameters_are_sent() -> None:
    plan = ok(completion(prompt="Hello", max_tokens=5, temperature=0))
    assert len(plan.calls) == 1
    assert plan.calls[0].kwargs == {"prompt": "Hello", "max_tokens": 5, "temperature": 0.0,
                                    "priority": 0}  # fmt: skip
    assert not plan.stream and plan.num_logprobs is None


def test_every_supported_parameter_reaches_the_engine() -> None:
    plan = ok(completion(prompt="x", max_tokens=7, temperature=0.5, top_p=0.9, top_k=40,
                         min_p=0.05, seed=11, stop=["\n", "END"], stop_token_ids=[2],
                         ignore_eos=True, priority=-3, logprobs=2, presence_penalty=0.5,
                         frequency_penalty=-0.5, repetition_penalty=1.1))  # fmt: skip
    kw = plan.calls[0].kwargs
    assert kw["top_k"] == 40 and kw["min_p"] == 0.05 and kw["seed"] == 11
    assert kw["stop"] == ["\n", "END"] and kw["stop_token_ids"] == [2]
    assert kw["ignore_eos"] is True and kw["priority"] == -3 and kw["logprobs"] == 2
    assert plan.num_logprobs == 2


@pytest.mark.parametrize("top_k", [-1, 0])
def test_vllm_style_disabled_top_k_is_left_out(top_k: int) -> None:
    assert "top_k" not in ok(completion(prompt="x", top_k=top_k)).calls[0].kwargs


def test_single_stop_string_becomes_a_list() -> None:
    assert ok(completion(prompt="x", stop="\n")).calls[0].kwargs["stop"] == ["\n"]


def test_n_fans_out_with_derived_seeds() -> None:
    plan = ok(completion(prompt="x", n=3, seed=100))
    assert [c.index for c in plan.calls] == [0, 1, 2]
    assert [c.kwargs["seed"] for c in plan.calls] == [100, 101, 102]
    unseeded = ok(completion(prompt="x", n=2))
    assert all("seed" not in c.kwargs for c in unseeded.calls)


def test_batched_prompts_times_n() -> None:
    plan = ok(completion(prompt=["a", "b"], n=2))
    assert [(c.index, c.prompt_index, c.kwargs["prompt"]) for c in plan.calls] == [
        (0, 0, "a"), (1, 0, "a"), (2, 1, "b"), (3, 1, "b"),
    ]  # fmt: skip


def test_token_id_prompts() -> None:
    assert ok(completion(prompt=[5, 6, 7])).calls[0].kwargs["prompt_token_ids"] == [5, 6, 7]
    plan = ok(completion(prompt=[[1, 2], [3]]))
    assert [c.kwargs["prompt_token_ids"] for c in plan.calls] == [[1, 2], [3]]


def test_stream_options() -> None:
    plan = ok(completion(prompt="x", stream=True, stream_options={"include_usage": True}))
    assert plan.stream and plan.include_usage
    assert not ok(completion(prompt="x", stream=True)).include_usage


def test_chat_messages_roles_parts_and_logprobs() -> None:
    plan = ok(chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user",
         "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ], logprobs=True, top_logprobs=3, max_tokens=4, max_completion_tokens=9))  # fmt: skip
    kw = plan.calls[0].kwargs
    assert kw["messages"] == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi there"}]  # fmt: skip
    assert kw["logprobs"] == 3 and plan.num_logprobs == 3
    assert kw["max_tokens"] == 9  # max_completion_tokens is OpenAI's newer name: it wins
    assert "logprobs" not in ok(chat(messages=[{"role": "user", "content": "x"}])).calls[0].kwargs


def test_default_max_tokens_from_settings() -> None:
    limits = GatewayLimits("smollm2", 8, default_max_tokens=64)
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    result = plan_chat(req, limits)
    assert isinstance(result, EngineCallPlan) and result.calls[0].kwargs["max_tokens"] == 64


# ---- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": ["a", "b", "c"], "n": 3}, "n"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": ""}, "stop"),
        ({"prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logit_bias": {"5": "a"}}, "logit_bias.5"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_parameters(body: dict[str, Any], param: str) -> None:
    err = rejected(body)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"
    assert err.message


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
          "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_chat_parameters(body: dict[str, Any], param: str) -> None:
    err = rejected(body, ChatRequest)
    assert err.status == 400 and err.param == param


def test_unknown_model_is_404_and_unknown_fields_are_ignored() -> None:
    err = completion(prompt="x", model="gpt-4")
    assert isinstance(err, ApiError) and err.status == 404 and err.code == "model_not_found"
    ok(completion(prompt="x", model="smollm2", user="someone", store=False))


def test_union_errors_name_the_accepted_shapes() -> None:
    err = rejected({"prompt": 5})
    assert "str" in err.message and "list[int]" in err.message


@pytest.mark.parametrize(
    "code, status",
    [("invalid_params", 400), ("prompt_too_long", 400), ("overloaded", 429),
     ("not_ready", 503), ("engine_unreachable", 503), ("worker_failed", 503),
     ("internal_error", 500)],
)  # fmt: skip
def test_engine_errors_map_to_http_statuses(code: str, status: int) -> None:
    err = from_engine_error(code, "why")
    assert err.status == status and err.code == code
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


# ---- through the real app (nothing listens at the engine address) ----------------------------


@pytest.fixture(scope="module")
def http() -> TestClient:
    config = GatewayConfig(engine_addr="tcp://127.0.0.1:9", api_key="sekrit")
    return TestClient(create_app(config, configure_logging("gateway-test", "warning")))


AUTH = {"Authorization": "Bearer sekrit"}


def test_http_400_is_openai_shaped(http: TestClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "x", "top_p": 7}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_p"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.post("/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_http_401_without_the_key(http: TestClient) -> None:
    """Every /v1 route refuses a request without the key (only /health and /metrics are
    open)."""
    routes = [("POST", "/v1/completions", {"prompt": "x"}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
              ("GET", "/v1/models", None)]  # fmt: skip
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key", (method, path)
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2"


def test_http_503_when_no_engine_answers() -> None:
    """Nothing listens at the engine address: after the silence timeout, 503, not a hang."""
    config = GatewayConfig(engine_addr=f"tcp://127.0.0.1:{_free_port()}", engine_timeout_s=0.3)
    app = create_app(config, configure_logging("gateway-test", "warning"))
    with TestClient(app) as client:  # one event loop for the app's engine client
        r = client.post("/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_unreachable"
        assert client.get("/health").status_code == 503


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
