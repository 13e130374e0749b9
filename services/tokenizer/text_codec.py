"""Text <-> token ids for one model: the Hugging Face tokenizer and its chat template.

Loaded once at start from the folder `shared.model_files.prepare_model` returns
(tokenizer.json, tokenizer_config.json with `chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from llguidance import LLTokenizer
from tokenizers import Tokenizer

from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from shared.protocol.client_channel import ChatMessage


class TextCodec:
    """Immutable after construction; every method is called on the service's one thread."""

    def __init__(self, tokenizer: Tokenizer, template: Optional[ChatTemplate]) -> None:
        self._tokenizer = tokenizer
        self._template = template

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """A raw prompt, tokenized as Hugging Face does by default (`tokenizer(text)`)."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> list[int]:
        """Render the chat template (with `tools`, chat_template.py), then tokenize without
        adding special tokens: the template writes them itself (as `apply_chat_template(...,
        tokenize=True)` does)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: send `prompt` instead")
        text = self._template.render(messages, add_generation_prompt, tools)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def grammar_tokenizer(self, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
        """This vocabulary for llguidance (structured outputs), `vocab_size` wide (~0.3 s).
        End-of-sequence ids this tokenizer does not have are left out (a simulated engine may
        name a larger model's): llguidance refuses them, and admission only checks compiles."""
        own_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos = [t for t in eos_token_ids if t < own_size]
        return LLTokenizer(self._tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos or None)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids; special tokens (end of sequence, ...) give no text."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def load_text_codec(folder: Path) -> TextCodec:
    """Read tokenizer.json and tokenizer_config.json; ValueError when they are unusable."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config_file = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    source = _template_source(config.get("chat_template"))
    template = None
    if source is not None:
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))
        template = ChatTemplate(source, bos_token=bos, eos_token=eos)
    return TextCodec(tokenizer, template)


def _template_source(value: Any) -> Optional[str]:
    """`chat_template` is a string, or a list of {"name", "template"} (use "default")."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _token_text(value: Any) -> str:
    """A special token in tokenizer_config.json: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
