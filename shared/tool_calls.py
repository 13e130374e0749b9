"""The default tool-call format, for chat templates without tool support (SmolLM2's has none).

The frontend renders with it (services/tokenizer/chat_template.py); the gateway builds the
grammar that forces a call and parses the reply with it (services/gateway/tools.py). It is the
Hermes / Qwen 2.5 format, so models trained on it read it as they were taught:

* the tools go into the system message: one line of instructions, then each function's
  definition as compact JSON inside <tools></tools>;
* a call is `<tool_call>\\n{"name":"NAME","arguments":{...}}\\n</tool_call>`; several calls
  follow one another; text before the first call is the message's content;
* an assistant message that made calls is rendered as its content followed by its calls;
* a tool's result is a user turn `<tool_response>\\n{CONTENT}\\n</tool_response>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions you can "
    "call are listed inside <tools></tools>. To call a function, write a JSON object with its "
    "name and arguments inside <tool_call></tool_call>, like this:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # compact JSON text of an object (OpenAI sends arguments as a string)


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system message's tool section (`tools`: OpenAI's list of {"type", "function"})."""
    lines = "\n".join(compact(t) for t in tools)
    return f"{INSTRUCTIONS}\n<tools>\n{lines}\n</tools>"


def calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's calls (OpenAI's tool_calls: {"id", "type", "function": {"name",
    "arguments": JSON text or a map}}) in the format the model writes them."""
    parts = []
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        try:
            args_value = json.loads(args) if isinstance(args, str) else (args or {})
        except ValueError:
            args_value = args  # rendered as the string it is
        parts.append(f"{CALL_OPEN}\n{compact({'name': fn.get('name'), 'arguments': args_value})}"
                     f"\n{CALL_CLOSE}")  # fmt: skip
    return "\n".join(parts)


def response_text(content: str) -> str:
    """A tool's result as the content of the user turn that carries it."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def parse_calls(text: str) -> Optional[tuple[str, list[ParsedCall]]]:
    """(content before the first call, the calls) when the reply holds at least one well-formed
    call (a JSON object with a string name and an object of arguments); None otherwise: the
    reply is plain content. Text after the last call is dropped."""
    found = list(_CALL.finditer(text))
    calls = []
    for match in found:
        try:
            body = json.loads(match.group(1))
        except ValueError:
            return None
        ok = isinstance(body, dict) and isinstance(body.get("name"), str)
        if not ok or not isinstance(body.get("arguments", {}), dict):
            return None
        calls.append(ParsedCall(body["name"], compact(body.get("arguments", {}))))
    if not calls:
        return None
    return text[: found[0].start()].strip(), calls


def call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose every sentence is one call (`parallel`: one
    or more) of one of `functions` (OpenAI's {"name", "parameters"}), its arguments valid for
    the function's parameters schema, as compact JSON."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }  # fmt: skip
        for fn in functions
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    repeat = f" ({json.dumps(chr(10))} call)*" if parallel else ""
    return (
        f"start: call{repeat}\n"
        f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
        f"body: %json {compact(schema)}"
    )
