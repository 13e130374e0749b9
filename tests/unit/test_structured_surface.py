"""Structured outputs and tools, everything but the model: the protocol's params and tool
fields, the frontend's compile cache (codes, limits, time-out, LRU), the chat template's tool
rendering (default format and native), the gateway's translation of response_format /
guided_* / tool_choice, and the reader that finds tool calls in a streamed reply. Runtime ~3 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from services.gateway.openai_schema import (
    ChatRequest,
    CompletionRequest,
    plan_chat,
    plan_completion,
)
from services.gateway.tools import CallOut, ToolCallReader, read_whole
from services.tokenizer.chat_template import ChatTemplate
from shared import tool_calls as tc
from shared.constraints import GrammarCache, load_tokenizer
from shared.protocol.client_channel import ChatMessage, ClientMessageError
from shared.protocol.client_channel.validate import decode_client_message
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import MAX_CONSTRAINT_BYTES, Constraint
from tests.support.tiny_model import CHAT_TEMPLATE, write_tiny_model
from tests.unit.test_gateway_schema import LIMITS

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _generate(params: dict | None = None, **fields: object):
    frame = {"type": "generate", "v": 1, "id": "a", "messages": USER, "params": params or {},
             **fields}  # fmt: skip
    return decode_client_message(msgpack.packb(frame))


def test_protocol_constraint_params() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    for given in (schema, json.dumps(schema)):
        c = _generate({"json_schema": given}).sampling.constraint
        assert c == Constraint(
            "json_schema", '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}'
        )
    assert _generate({"json_object": True}).sampling.constraint == Constraint("json_object")
    assert _generate({"json_object": False}).sampling.constraint is None
    assert _generate({"choice": ["x", "y"]}).sampling.constraint.spec == '["x", "y"]'
    assert _generate({"logit_bias": {5: 1, "7": -2.5}}).sampling.logit_bias == {"5": 1, "7": -2.5}
    for bad in ({"regex": "a", "grammar": "start: a"}, {"json_schema": [1]}, {"choice": []},
                {"regex": ""}, {"logit_bias": {"x": 1}}, {"logit_bias": {"5": 200}},
                {"json_schema": "{not json"}, {"regex": "a", "ignore_eos": True}):  # fmt: skip
        with pytest.raises(ClientMessageError) as info:
            _generate(bad)
        assert info.value.code == ErrorCode.INVALID_PARAMS, bad


def test_protocol_tool_fields() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]  # fmt: skip
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    cmd = _generate(messages=msgs, tools=[TOOL])
    assert cmd.tools == [TOOL]
    assert cmd.messages[1] == ChatMessage("assistant", "", tool_calls=calls)
    assert cmd.messages[2].tool_call_id == "c1"
    for bad in ({"tools": [{"type": "function"}]}, {"tools": []},
                {"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]}):  # fmt: skip
        with pytest.raises(ClientMessageError) as info:
            _generate(**bad)
        assert info.value.code == ErrorCode.INVALID_PROMPT, bad


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> GrammarCache:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    return GrammarCache(load_tokenizer(Path(folder), 265, [2]), size=2)


def test_compile_codes_limits_and_the_cache(cache: GrammarCache) -> None:
    def code(c: Constraint) -> str | None:
        err = cache.check(c)
        return None if err is None else err.code

    ok = Constraint("regex", "[a-z]+")
    assert code(ok) is None and code(ok) is None and cache.num_hits == 1
    unsupported = Constraint("json_schema", '{"type":"array","uniqueItems":true}')
    assert code(unsupported) == "invalid_constraint"
    assert "uniqueItems" in cache.check(unsupported).message  # names the feature
    assert code(Constraint("grammar", "start: nope")) == "invalid_constraint"
    assert code(Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1))) == "constraint_too_large"
    for spec in ("[0-9]+", "[A-Z]+", "x+"):  # size 2: the oldest entries leave
        assert code(Constraint("regex", spec)) is None
    assert Constraint("regex", "[a-z]+") not in cache._compiled  # noqa: SLF001 - the LRU itself
    slow = GrammarCache(cache.tokenizer, timeout_s=1e-6)
    assert slow.check(Constraint("json_object")).code == "constraint_too_slow"


def test_chat_template_renders_tools_in_the_default_format() -> None:
    template = ChatTemplate(CHAT_TEMPLATE, eos_token="<|im_end|>")
    assert not template.reads_tools
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    msgs = [ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=[call]),
            ChatMessage("tool", "sunny", tool_call_id="c1")]  # fmt: skip
    text = template.render(msgs, True, tools=[TOOL])
    assert text.startswith("<|im_start|>system\n" + tc.INSTRUCTIONS)
    assert "<tools>\n" + tc.compact(TOOL) + "\n</tools>" in text
    assert '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    native = ChatTemplate("{{ tools | length }}:{{ messages[1].tool_calls[0].id }}")
    assert native.reads_tools and native.render(msgs, True, tools=[TOOL]) == "1:c1"


def test_call_grammar_forces_valid_calls(cache: GrammarCache) -> None:
    fn = TOOL["function"]
    for parallel in (False, True):
        grammar = Constraint("grammar", tc.call_grammar([fn], parallel))
        one = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>'
        texts = {one: True, one + "\n" + one: parallel, one.replace("get_weather", "x"): False,
                 one.replace('"Rome"', "5"): False}  # fmt: skip
        for text, accepted in texts.items():
            m = cache.matcher(grammar)
            ok = all(m.consume_token(t) for t in cache.tokenizer.tokenize_str(text))
            assert (ok and m.is_accepting()) == accepted, (parallel, text)
    parsed = tc.parse_calls("Sure. " + one)
    assert parsed == ("Sure.", [tc.ParsedCall("get_weather", '{"city":"Rome"}')])
    assert tc.parse_calls("no call here") is None


def test_reader_streams_content_and_calls() -> None:
    text = 'Let me check. <tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>\n'
    text += '<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>'
    reader = ToolCallReader()
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = [p for p in pieces if isinstance(p, CallOut)]
    assert content == "Let me check. " and [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "f", '{"a":1}'), (1, "g", "{}")]  # fmt: skip
    assert all(not p.startswith("<") for p in pieces if isinstance(p, str))  # held back
    assert read_whole("<tool_call>not json</tool_call> x") == (
        "<tool_call>not json</tool_call> x",
        [],
    )
    assert read_whole('<tool_call>\n{"name":"f"') == ('<tool_call>\n{"name":"f"', [])  # cut


def test_gateway_translates_constraints_and_tool_choices() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    plan = plan_chat(ChatRequest.model_validate({"messages": USER, "response_format": fmt}), LIMITS)
    assert plan.calls[0].kwargs["json_schema"] == {"type": "object"} and plan.tool_mode is None
    body = {"prompt": "x", "guided_choice": ["a", "b"], "logit_bias": {"5": -100}}
    plan = plan_completion(CompletionRequest.model_validate(body), LIMITS)
    assert plan.calls[0].kwargs["choice"] == ["a", "b"]
    assert plan.calls[0].kwargs["logit_bias"] == {"5": -100}
    for choice, forced, grammar in (("auto", False, False), ("required", True, True),
                                    ({"type": "function", "function": {"name": "get_weather"}},
                                     True, True)):  # fmt: skip
        body = {"messages": USER, "tools": [TOOL], "tool_choice": choice}
        plan = plan_chat(ChatRequest.model_validate(body), LIMITS)
        assert plan.tool_mode is not None and plan.tool_mode.forced == forced
        assert ("grammar" in plan.calls[0].kwargs) == grammar
        assert plan.calls[0].kwargs["tools"][0]["function"]["name"] == "get_weather"
    plan = plan_chat(ChatRequest.model_validate(
        {"messages": USER, "tools": [TOOL], "tool_choice": "none"}), LIMITS)  # fmt: skip
    assert plan.tool_mode is None and "tools" not in plan.calls[0].kwargs
