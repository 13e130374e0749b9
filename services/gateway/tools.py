"""A chat reply read for tool calls (the default format, shared/tool_calls.py), as it streams.

`ToolCallReader.feed` takes each new piece of text and returns what can be told already: content
(text outside calls; text that may be the start of `<tool_call>` is held back, as a stop string
would be) and each call once its `</tool_call>` has arrived. A call whose body is not a JSON
object with a name and arguments is content after all. Whitespace between calls is dropped.
The same reader serves the non-streamed response (fed the whole text at once).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Union

from shared import tool_calls as tc


@dataclass(frozen=True, slots=True)
class CallOut:
    """One complete call, as OpenAI names it."""

    index: int  # its place among the choice's calls
    id: str
    name: str
    arguments: str  # compact JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


Piece = Union[str, CallOut]


class ToolCallReader:
    """One choice's reader; feed it in order, then `finish` once."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[CallOut] = []

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buffer.find(tc.CALL_CLOSE)
                if end < 0:
                    return out
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(tc.CALL_CLOSE) :]
                self._in_call = False
                out.append(self._call(body))
                continue
            start = self._buffer.find(tc.CALL_OPEN)
            if start < 0:
                keep = _held_back(self._buffer)
                self._emit(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._emit(out, self._buffer[:start])
            self._buffer = self._buffer[start + len(tc.CALL_OPEN) :]
            self._in_call = True

    def finish(self) -> list[Piece]:
        """What is left at the end: an unfinished call is content (cut by max_tokens)."""
        left = (tc.CALL_OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        out: list[Piece] = []
        self._emit(out, left)
        return out

    def _call(self, body: str) -> Piece:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        args = value.get("arguments", {}) if isinstance(value, dict) else None
        if (
            not isinstance(value, dict)
            or not isinstance(value.get("name"), str)
            or not (isinstance(args, dict))
        ):
            return f"{tc.CALL_OPEN}{body}{tc.CALL_CLOSE}"
        call = CallOut(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", value["name"],
                       tc.compact(args))  # fmt: skip
        self.calls.append(call)
        return call

    def _emit(self, out: list[Piece], text: str) -> None:
        if text and not (self.calls and text.isspace()):
            out.append(text)


def _held_back(text: str) -> int:
    """How many characters at the end of `text` may be the start of `<tool_call>`."""
    for n in range(min(len(text), len(tc.CALL_OPEN) - 1), 0, -1):
        if tc.CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def read_whole(text: str) -> tuple[str, list[CallOut]]:
    """A non-streamed reply: (its content, its calls)."""
    reader = ToolCallReader()
    pieces = [*reader.feed(text), *reader.finish()]
    content = "".join(p for p in pieces if isinstance(p, str))
    return content.strip() if reader.calls else content, reader.calls
