"""Text <-> value for one config field's annotation: what a flag or a CONVEYOR_* variable may
say, and how a value is written back (shared/config_flags.py builds flags from these).

    bool                    true|false|1|0|yes|no|on|off
    int, float, str, Path   as written; `*_memory` / `*_bytes` ints also take 1GiB, 512M ...
    Literal[...], Enum      one of their values
    Optional[X]             X, or none|null for None
    tuple[X, ...]           comma-separated items (a pair item, tuple[int, int], is A:B)
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

_NONE_WORDS = ("none", "null")


@dataclass(frozen=True)
class Converter:
    """`one` turns a flag's text into its value (argparse's `type`; a list flag's items come
    back as a tuple); `kind` is "value", "switch" (a bool) or "list"."""

    one: Callable[[str], Any]
    kind: str
    type_name: str
    nullable: bool = False
    allowed: Optional[tuple] = None  # the values allowed, when the annotation or metadata says

    @property
    def choices(self) -> Optional[list]:
        """argparse's `choices` (a list flag checks its items itself)."""
        if self.allowed is None or self.kind == "list":
            return None
        return [*self.allowed, None] if self.nullable else list(self.allowed)

    def parse(self, text: str) -> Any:
        """A variable's text -> the value (the same as the flag's)."""
        return self.one(text)

    def text(self, value: Any) -> str:
        """The inverse of `parse`."""
        if self.kind == "list":
            return ",".join(_item_text(v) for v in value)
        return _item_text(value)


def show(value: Any) -> str:
    """A default as --help and docs/cli.md show it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, tuple):
        return repr(",".join(_item_text(v) for v in value))
    return repr(_item_text(value))


def converter(
    hint: Any, choices: Optional[Any] = None, byte_size: bool = False
) -> Optional[Converter]:
    """The Converter of one annotation, or None when no command line can express it."""
    nullable = False
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) != 1:
            return None
        hint, nullable = inner[0], True
    if typing.get_origin(hint) is tuple:
        return _list_converter(hint, choices, nullable)
    base = parse_size if byte_size and hint is int else _base(hint)
    if base is None:
        return None
    allowed = tuple(choices) if choices is not None else _literal(hint)
    kind = "switch" if hint is bool else "value"
    name = _type_name(hint, base, allowed)
    one = _nullable(base) if nullable else base
    return Converter(one, kind, name, nullable, allowed)


def _list_converter(hint: Any, choices: Optional[Any], nullable: bool) -> Optional[Converter]:
    args = typing.get_args(hint)
    if len(args) != 2 or args[1] is not Ellipsis or nullable:
        return None
    item = _pair(args[0]) if typing.get_origin(args[0]) is tuple else _base(args[0])
    if item is None:
        return None
    allowed = tuple(choices) if choices is not None else _literal(args[0])

    def items(text: str) -> tuple:
        values = tuple(item(part.strip()) for part in text.split(",") if part.strip())
        bad = [v for v in values if allowed is not None and v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {allowed}")
        return values

    items.__name__ = "list"
    return Converter(items, "list", f"list of {_type_name(args[0], item, allowed)}", False, allowed)


def _pair(hint: Any) -> Optional[Callable[[str], tuple]]:
    """tuple[int, int] -> 'A:B'."""
    parts = [_base(a) for a in typing.get_args(hint)]
    if not parts or Ellipsis in typing.get_args(hint) or any(p is None for p in parts):
        return None

    def pair(text: str) -> tuple:
        values = text.split(":")
        if len(values) != len(parts):
            raise argparse.ArgumentTypeError(f"{text!r} is not {':'.join('X' * len(parts))}")
        return tuple(p(v) for p, v in zip(parts, values, strict=True))  # type: ignore[misc]

    return pair


def _base(hint: Any) -> Optional[Callable[[str], Any]]:
    if hint is bool:
        return parse_bool
    if hint in (int, float, str, Path):
        return hint
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(a) for a in typing.get_args(hint)}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def _literal(hint: Any) -> Optional[tuple]:
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return tuple(hint)
    return None


def _type_name(hint: Any, base: Callable, allowed: Optional[tuple]) -> str:
    if allowed is not None:
        return "|".join(str(_item_text(a)) for a in allowed)
    if base is parse_size:
        return "size"
    if typing.get_origin(hint) is tuple:
        return ":".join(a.__name__ for a in typing.get_args(hint))
    return {parse_bool: "bool", Path: "path"}.get(base, getattr(base, "__name__", "value"))


def _nullable(base: Callable[[str], Any]) -> Callable[[str], Any]:
    def maybe(text: str) -> Any:
        return None if text.lower() in _NONE_WORDS else base(text)

    maybe.__name__ = getattr(base, "__name__", "value")
    return maybe


def _item_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ":".join(_item_text(v) for v in value)
    return str(value)


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'1073741824', '1GiB', '512M', '1.5g' -> bytes (binary units)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(raw[-1:], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1GiB)") from None


parse_size.__name__ = "size"


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean")
