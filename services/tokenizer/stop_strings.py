"""Stop strings: find the first one in the generated text, and hold back text that may be
the start of one (so a streamed chunk never shows part of a stop string)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class StopMatch:
    start: int  # index in the text where the stop string begins: the text is cut there
    stop: str


class StopStrings:
    """Immutable matcher over a request's stop strings (empty list: never matches)."""

    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = list(stops)
        self._max_len = max((len(s) for s in stops), default=0)

    def find(self, text: str, new_from: int) -> Optional[StopMatch]:
        """The earliest stop string that ends in text[new_from:] (earlier text was checked)."""
        if not self.stops:
            return None
        start = max(0, new_from - self._max_len + 1)
        best: Optional[StopMatch] = None
        for stop in self.stops:
            i = text.find(stop, start)
            if i != -1 and (best is None or i < best.start):
                best = StopMatch(i, stop)
        return best

    def holdback(self, text: str) -> int:
        """How many characters at the end of `text` may begin a stop string (not yet safe)."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
