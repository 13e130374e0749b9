"""Structured outputs end to end, through the official `openai` client: validity over the schema
set (bench/structured_schemas.py, 24 schemas) greedy and sampled, streamed and not (96
requests, 16 at a time); a reply that does not parse, does not validate (jsonschema) or was cut
by max_tokens counts as invalid. Then a tool round trip: `tool_choice="required"` and a named
function, the calls' arguments validated, the tool's result sent back, the model's answer.

Starts its own stack (the real model in fp32, with the gateway) unless --url names a gateway.

    PYTHONPATH=. .venv/bin/python bench/structured_validity.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import jsonschema
import openai

from bench.structured_schemas import CASES, MAX_TOKENS, SchemaCase
from conveyor.launcher import LocalStack, StackSettings
from services.gateway.config import GatewayConfig
from services.worker.config import WorkerConfig
from tests.e2e.stack_tools import free_port

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip


def ask(client: openai.OpenAI, case: SchemaCase, sampled: bool, stream: bool) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema,
                                                  "strict": True}}  # fmt: skip
    kwargs: dict[str, Any] = dict(
        model="smollm2", messages=[{"role": "user", "content": case.prompt}],
        max_tokens=MAX_TOKENS, response_format=fmt, temperature=0.8 if sampled else 0.0,
        seed=11 if sampled else None,
    )  # fmt: skip
    if stream:
        parts, finish = [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        text = "".join(parts)
    else:
        out = client.chat.completions.create(**kwargs)
        text, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
    problem: Optional[str] = None
    try:
        jsonschema.validate(json.loads(text), case.schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        problem = f"{type(exc).__name__}: {str(exc)[:120]}"
    if finish != "stop":
        problem = problem or f"finish_reason {finish}"
    return {"schema": case.name, "sampled": sampled, "stream": stream, "text": text,
            "problem": problem}  # fmt: skip


def validity(client: openai.OpenAI) -> dict[str, Any]:
    jobs = [(c, s, st) for c in CASES for s in (False, True) for st in (False, True)]
    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda job: ask(client, *job), jobs))
    bad = [r for r in results if r["problem"]]
    for r in bad:
        print(json.dumps(r))
    return {"requests": len(results), "valid": len(results) - len(bad),
            "schemas": len(CASES), "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def tool_round_trip(client: openai.OpenAI) -> dict[str, Any]:
    ask_msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    out: dict[str, Any] = {}
    for label, choice in (
        ("required", "required"),
        ("named", {"type": "function", "function": {"name": "get_time"}}),
    ):
        reply = client.chat.completions.create(
            model="smollm2", messages=ask_msgs, tools=[WEATHER, TIME], tool_choice=choice,
            max_tokens=80, temperature=0.0)  # fmt: skip
        call = reply.choices[0].message.tool_calls[0]
        fn = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), fn["function"]["parameters"])
        answer = client.chat.completions.create(
            model="smollm2", tools=[WEATHER, TIME], max_tokens=40, temperature=0.0,
            messages=[*ask_msgs, {"role": "assistant", "content": None,
                                  "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id,
                       "content": '{"sky":"sunny","celsius":21}'}])  # fmt: skip
        out[label] = {"finish_reason": reply.choices[0].finish_reason,
                      "call": {"name": call.function.name, "arguments": call.function.arguments},
                      "answer": answer.choices[0].message.content}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running gateway (default: start a stack)")
    args = parser.parse_args()
    stack = None
    url = args.url
    if url is None:
        settings = StackSettings(
            frontend_address=f"tcp://127.0.0.1:{free_port()}", gateway=True,
            worker_config=WorkerConfig(dtype="float32", kv_cache_memory=512 << 20),
            gateway_config=GatewayConfig(http_port=free_port()),
            log_dir=Path(tempfile.mkdtemp(prefix="structured-validity-")),
        )  # fmt: skip
        stack = LocalStack(settings).start()
        stack.wait_ready(timeout=600)
        url = str(stack.http_url)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        print(json.dumps({"validity": validity(client)}), flush=True)
        print(json.dumps({"tools": tool_round_trip(client)}))
    finally:
        if stack is not None:
            stack.stop()


if __name__ == "__main__":
    main()
