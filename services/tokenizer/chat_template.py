"""The model's chat template (Jinja, from tokenizer_config.json), rendered in a sandbox.

Templates come with model files, so they are untrusted: the immutable sandbox forbids
attribute tricks and mutation. The environment offers what Hugging Face templates expect
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, loop controls).

Tools: a template that reads `tools` gets them, and the messages' `tool_calls` and
`tool_call_id`, as Hugging Face templates expect. Any other template (SmolLM2's) gets the
default format instead (shared/tool_calls.py): the tools in the system message, an assistant's
calls written after its content, a tool's result as a user turn in <tool_response>.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared import tool_calls as tc
from shared.protocol.client_channel import ChatMessage


class ChatTemplateError(ValueError):
    """The template failed on these messages (e.g. it rejects a role order)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """Compiled once at start; `render` is called per chat request."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the model's chat template does not compile: {exc}") from None
        self._bos = bos_token
        self._eos = eos_token
        self.reads_tools = "tools" in source  # else: the default tool format

    def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> str:
        """The prompt text for a chat; raises ChatTemplateError when the template refuses it."""
        native = self.reads_tools
        items = [_native_item(m) if native else _default_item(m) for m in messages]
        extra: dict[str, Any] = {}
        if tools and native:
            extra["tools"] = tools
        elif tools:
            items = _with_tools_in_system(items, tc.tools_text(tools))
        try:
            return self._template.render(
                messages=items,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                **extra,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template's own bugs too
            raise ChatTemplateError(f"chat template: {exc}") from None


def _native_item(m: ChatMessage) -> dict[str, Any]:
    item: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        item["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        item["tool_call_id"] = m.tool_call_id
    return item


def _default_item(m: ChatMessage) -> dict[str, Any]:
    """A message in the default tool format: calls after the content, results as user turns."""
    if m.role == "tool":
        return {"role": "user", "content": tc.response_text(m.content)}
    if m.tool_calls:
        text = tc.calls_text(m.tool_calls)
        return {"role": m.role, "content": f"{m.content}\n{text}" if m.content else text}
    return {"role": m.role, "content": m.content}


def _with_tools_in_system(items: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if items and items[0]["role"] == "system":
        first = {**items[0], "content": f"{items[0]['content']}\n\n{text}"}
        return [first, *items[1:]]
    return [{"role": "system", "content": text}, *items]
