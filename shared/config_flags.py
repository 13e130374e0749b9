"""Command-line flags generated from a frozen config dataclass, one flag per field.

`--max-num-seqs 8` sets `max_num_seqs`; when the flag is absent, `CONVEYOR_MAX_NUM_SEQS` is used,
and when that is unset too, the dataclass default stands (the flag is left out of the namespace,
so the dataclass stays the one place defaults live). A field's `metadata["help"]`, when given,
is the flag's help text. Values are validated by the dataclass's own `__post_init__`;
`config_from_args` turns its ValueError into an argparse error.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

from shared.env import PREFIX, env_str


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """The environment variable (without CONVEYOR_) that sets a config field."""
    return field_name.upper()


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> list[str]:
    """Add one flag per field of dataclass `cls`; returns the field names that got a flag."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} (flag, else {PREFIX}<FIELD>, else default)")
    added = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        convert, choices, nullable = _converter(hints[f.name], byte_size=_is_size(f.name))
        if convert is None:
            continue  # a field no command line can express (e.g. a nested structure)
        default = f.default if f.default is not dataclasses.MISSING else None
        env_value = env_str(env_name(f.name))
        is_switch = hints[f.name] is bool
        group.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=convert,
            choices=choices,
            # argparse applies `type` to string defaults, so the environment is parsed too.
            default=env_value if env_value is not None else argparse.SUPPRESS,
            metavar=None if choices else f.name.upper(),
            help=_help(f, default, nullable),
            # a bool: `--flag` alone means true, `--flag false` still works, `--no-flag` too
            **({"nargs": "?", "const": True} if is_switch else {}),
        )
        if is_switch:
            group.add_argument(
                "--no-" + flag_name(f.name)[2:],
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,
                help=f"{flag_name(f.name)} false",
            )
        added.append(f.name)
    return added


def _help(f: dataclasses.Field, default: Any, nullable: bool) -> str:
    """A field's `metadata["help"]` (when it has one) and its default."""
    text = f"default {default!r}" + (" ('none' for None)" if nullable else "")
    what = f.metadata.get("help")
    return f"{what} ({text})" if what else text


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, cls: type) -> Any:
    """Build `cls` from the parsed flags; an invalid value exits like any bad flag."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        parser.error(str(exc))


def _is_size(field_name: str) -> bool:
    return field_name.endswith(("_memory", "_bytes"))


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


def _converter(
    hint: Any, byte_size: bool = False
) -> tuple[Optional[Callable[[str], Any]], Optional[list], bool]:
    """(string -> value, choices, accepts 'none') for one annotation; (None, ..) if unsupported."""
    nullable = False
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) != 1:
            return None, None, False
        hint, nullable = inner[0], True
    base = parse_size if byte_size and hint is int else _base_converter(hint)
    choices = None
    if typing.get_origin(hint) is typing.Literal:
        choices = list(typing.get_args(hint))
    if base is None:
        return None, None, False
    if not nullable:
        return base, choices, False

    def maybe(text: str) -> Any:
        return None if text.lower() in ("none", "null", "") else base(text)

    maybe.__name__ = getattr(base, "__name__", "value")
    return maybe, (choices + [None] if choices else None), True


def _base_converter(hint: Any) -> Optional[Callable[[str], Any]]:
    if hint is bool:
        return _parse_bool
    if hint in (int, float, str):
        return hint
    if hint is Path:
        return Path
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if typing.get_origin(hint) is typing.Literal:
        kinds = {type(a) for a in typing.get_args(hint)}
        return kinds.pop() if len(kinds) == 1 else None
    return None


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean")
