"""Incremental detokenization that never ends a piece of text inside a UTF-8 character.

Byte-level tokenizers split multi-byte characters across tokens: decoding a prefix of the ids
then ends in U+FFFD. Each step decodes a short window (a few tokens already emitted, for context,
plus the new ones) and releases the new text only when it does not end in U+FFFD; otherwise the
tokens wait for the next step. The concatenation of every piece equals decoding all the ids
(for tokenizers whose decoding of a window does not depend on tokens before it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, so that decoders that treat the
# start of a text specially (e.g. strip a leading space) see the first output in context.
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Per-request state; `push` is called with each step's new ids, in order.

    Invariant: ids[prefix:read] is already emitted and decodes to whole characters;
    ids[read:] are not emitted yet.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """New ids -> the text they complete ("" while a character is incomplete).

        `final`: no more ids will come, so release what is left even if it ends in U+FFFD (the
        bytes of that character will never complete; decoding all ids gives the same).
        """
        self._ids.extend(new_ids)
        if len(self._ids) == self._read:
            return ""
        done_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done_text) or (text.endswith(REPLACEMENT) and not final):
            return ""  # special tokens only (no text), or a character still incomplete
        # Slide the window: what was new becomes the context of the next step.
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done_text) :]
