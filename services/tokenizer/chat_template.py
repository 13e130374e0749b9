"""The model's chat template (Jinja, from tokenizer_config.json), rendered in a sandbox.

Templates come with model files, so they are untrusted: the immutable sandbox forbids
attribute tricks and mutation. The environment offers what Hugging Face templates expect
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, loop controls).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat; raises ChatTemplateError when the template refuses it."""
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template's own bugs too
            raise ChatTemplateError(f"chat template: {exc}") from None
