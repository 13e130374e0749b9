"""The API keys the gateway accepts, and the latency-target class each one gives its requests.

Keys come from `--api-key` (one key, no class) and `--api-key-file` (several): one key per line,
optionally followed by the name of an engine latency-target class (`--slo-classes` on the
engine), `#` starts a comment:

    sk-dashboard-7f3a  interactive
    sk-nightly-91c2    batch
    sk-tools-0b44

A request sent with a key that has a class gets that class when it names none itself
(`slo_class` in the body wins); a class the engine does not know fails the request with
`invalid_params`, as naming it in the body would. Keys live in a file, not on the command line,
so that they do not show in the process list.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from starlette.types import Scope


@dataclass(frozen=True, slots=True)
class ApiKey:
    key: str
    slo_class: Optional[str] = None  # None: the request's own, else the engine's default

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError("an API key must be non-empty, without spaces")


def parse_key_file(text: str, source: str = "the API key file") -> list[ApiKey]:
    """The keys of a key file's text; ValueError naming the first bad line."""
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for num, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{source}, line {num}: want 'KEY [SLO_CLASS]'")
        if words[0] in seen:
            raise ValueError(f"{source}, line {num}: the same key twice")
        seen.add(words[0])
        keys.append(ApiKey(words[0], words[1] if len(words) == 2 else None))
    if not keys:
        raise ValueError(f"{source} holds no key")
    return keys


class ApiKeys:
    """Checks a request's `Authorization: Bearer KEY` header against every accepted key."""

    def __init__(self, keys: list[ApiKey]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key (no keys: no authentication)")
        self._expected = [(f"Bearer {k.key}".encode(), k) for k in keys]

    @classmethod
    def load(cls, api_key: Optional[str], key_file: Optional[Path]) -> Optional[ApiKeys]:
        """The keys of `--api-key` and `--api-key-file`; None when neither is set (then the
        gateway asks for no key). Called once at start; a bad file stops the gateway."""
        keys = [ApiKey(api_key)] if api_key is not None else []
        if key_file is not None:
            keys += parse_key_file(key_file.read_text(), str(key_file))
        if len({k.key for k in keys}) < len(keys):
            raise ValueError("--api-key is also in --api-key-file")
        return cls(keys) if keys else None

    def match(self, scope: Scope) -> Optional[ApiKey]:
        """The key the request was sent with; None when it has none of ours."""
        header = next((v for n, v in scope.get("headers", ()) if n == b"authorization"), None)
        if header is None:
            return None
        found: Optional[ApiKey] = None
        for expected, key in self._expected:  # every key compared, in constant time each: the
            if hmac.compare_digest(header, expected):  # response time tells nothing of a key
                found = key
        return found
