"""Structured outputs and tool calls on the session's real engine (SmolLM2, fp32, llguidance),
through the official `openai` client and the ZeroMQ client:

1. a subset of the schema set (bench/structured_schemas.py) parses and validates, greedy and
   non-streamed, sampled and streamed; regex, choice and a Lark grammar too;
2. an unconstrained request beside a constrained one gives the text it gives alone;
3. bad schemas are refused with their codes while a normal stream runs on and finishes;
4. a tool round trip: `required` and a named function give calls whose arguments validate
   (streamed: the deltas add up to them), the tool's result goes back, the model answers.

Rough runtime: 60-120 s on the shared 2-core machine (about 20 requests of up to ~80 tokens,
in five batches).
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from bench.structured_schemas import CASES, MAX_TOKENS
from shared.client import AsyncClient, Client

pytestmark = pytest.mark.e2e

SUBSET = ("nested_address", "scores", "one_of_shape", "temperature", "code_pattern")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },  # fmt: skip
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },  # fmt: skip
}


def _client(engine: Any) -> openai.OpenAI:
    assert engine.http_url, "the session engine runs the gateway"
    return openai.OpenAI(base_url=engine.http_url + "/v1", api_key="x", max_retries=0)


def _ask(client: openai.OpenAI, case: Any, sampled: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema,
                                                  "strict": True}}  # fmt: skip
    kwargs: dict[str, Any] = dict(
        model="smollm2", messages=[{"role": "user", "content": case.prompt}],
        max_tokens=MAX_TOKENS, response_format=fmt,
        temperature=0.8 if sampled else 0.0, seed=7 if sampled else None,
    )  # fmt: skip
    if not sampled:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content or ""
    parts, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    return "".join(parts)


def test_schemas_validate_greedy_and_sampled_streamed(engine: Any) -> None:
    client = _client(engine)
    cases = [c for c in CASES if c.name in SUBSET]
    jobs = [(c, sampled) for c in cases for sampled in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one batch in the engine
        texts = list(pool.map(lambda job: _ask(client, *job), jobs))
    for (case, _), text in zip(jobs, texts, strict=True):
        assert "\n" not in text and not text.startswith(" "), text  # compact JSON
        jsonschema.validate(json.loads(text), case.schema)


def test_regex_choice_and_grammar(engine: Any) -> None:
    msgs = [{"role": "user", "content": "Give a product code."}]

    async def three() -> list[Any]:
        async with AsyncClient(engine.frontend_address, timeout=120.0) as c:
            return await asyncio.gather(
                c.generate(messages=msgs, max_tokens=20, temperature=0.0,
                           regex="[A-Z]{3}-[0-9]{3}"),
                c.generate("The best fruit is", max_tokens=10, temperature=0.0,
                           choice=["apple", "banana", "cherry"]),
                c.generate("1+2=", max_tokens=30, temperature=0.0,
                           grammar='start: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'),
            )  # fmt: skip

    code, pick, sums = asyncio.run(three())
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", code.text) and code.finish_reason == "stop"
    assert pick.text in ("apple", "banana", "cherry")
    assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", sums.text), sums.text


def test_unconstrained_request_beside_a_constrained_one_is_unchanged(engine: Any) -> None:
    prompt = "Conveyor belts move parcels because"
    schema = next(c for c in CASES if c.name == "rgb")

    async def both() -> list[Any]:
        async with AsyncClient(engine.frontend_address, timeout=120.0) as c:
            return await asyncio.gather(
                c.generate(prompt, max_tokens=16, temperature=0.0),
                c.generate(messages=[{"role": "user", "content": schema.prompt}],
                           max_tokens=MAX_TOKENS, temperature=0.0, json_schema=schema.schema),
            )  # fmt: skip

    with Client(engine.frontend_address, timeout=120.0) as c:
        alone = c.generate(prompt, max_tokens=16, temperature=0.0)
    plain, constrained = asyncio.run(both())
    assert plain.token_ids == alone.token_ids
    jsonschema.validate(json.loads(constrained.text), schema.schema)


def test_bad_schemas_are_refused_while_a_stream_runs(engine: Any) -> None:
    client = _client(engine)
    stream = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=40,
                                       temperature=0.0, stream=True)  # fmt: skip
    first = next(iter(stream))
    bad = {
        "uniqueItems": ({"type": "array", "uniqueItems": True}, "invalid_constraint"),
        "Unknown format": ({"type": "string", "format": "colour"}, "invalid_constraint"),
        "over 65536 bytes": ({"enum": ["x" * 70_000]}, "constraint_too_large"),
    }
    for words, (schema, code) in bad.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema}},
            )  # fmt: skip
        err = info.value.body
        assert isinstance(err, dict) and err.get("code") == code, err
        assert words in err.get("message", ""), err
    rest = [c for c in stream]
    assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason == "length"


def _calls(client: openai.OpenAI, messages: list[dict], tools: list, choice: Any) -> Any:
    return client.chat.completions.create(
        model="smollm2", messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=False, max_tokens=80, temperature=0.0,
    )  # fmt: skip


def _streamed_call(client: openai.OpenAI, messages: list[dict]) -> dict[str, str]:
    """A required call, streamed: its name and arguments added up from the deltas."""
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required",
        max_tokens=80, temperature=0.0, parallel_tool_calls=False, stream=True,
    ):  # fmt: skip
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed["name"] += delta.function.name or ""
            streamed["arguments"] += delta.function.arguments or ""
    return streamed


def test_tool_round_trip_required_and_named(engine: Any) -> None:
    client = _client(engine)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named_choice = {"type": "function", "function": {"name": "get_time"}}
    with ThreadPoolExecutor(3) as pool:  # one batch in the engine
        required = pool.submit(_calls, client, ask, [WEATHER, TIME], "required")
        named_job = pool.submit(_calls, client, ask, [WEATHER, TIME], named_choice)
        streamed = pool.submit(_streamed_call, client, ask).result()
        out, named = required.result(), named_job.result()
    msg, finish = out.choices[0].message, out.choices[0].finish_reason
    assert finish == "tool_calls" and msg.tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    fn = next(t["function"] for t in (WEATHER, TIME) if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    named_call = named.choices[0].message.tool_calls[0]
    assert named_call.function.name == "get_time"
    jsonschema.validate(json.loads(named_call.function.arguments), TIME["function"]["parameters"])
    assert streamed["name"] == "get_weather"
    jsonschema.validate(json.loads(streamed["arguments"]), WEATHER["function"]["parameters"])
    answer = client.chat.completions.create(
        model="smollm2", tools=[WEATHER, TIME], max_tokens=24, temperature=0.0,
        messages=[*ask, {"role": "assistant", "content": None,
                         "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"sky":"sunny","c":21}'}],
    )  # fmt: skip
    assert answer.choices[0].message.content  # the model answers from the tool's result
