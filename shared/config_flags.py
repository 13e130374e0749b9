"""Command-line flags and CONVEYOR_* variables generated from frozen config dataclasses.

One flag per field: `--max-num-seqs 8` sets `max_num_seqs`; when the flag is absent,
`CONVEYOR_MAX_NUM_SEQS` is used, and when that is unset too, the dataclass default stands (the
flag is left out of the namespace, so the dataclass stays the one place defaults live). Values
are validated by the dataclass's own `__post_init__`; `config_from_args` turns its ValueError
into an argparse error. `config_argv` is the inverse: a config -> the flags that rebuild it
(how the launcher hands a config to a service process).

A field's metadata, all optional:
  help          the flag's help text
  internal      True: a knob for tests and experiments, not a user setting; its flag and
                variable work, --help hides them, docs/cli.md lists them apart
  flag          the setting's name when it is not the field's: `flag="scheduler_addr"` gives
                --scheduler-addr and CONVEYOR_SCHEDULER_ADDR (a field ending in `_s`, seconds,
                drops it by default: `drain_timeout_s` is --drain-timeout)
  env           the variable(s) instead of CONVEYOR_<NAME>: a name, a tuple (the first one set
                wins), or None for none (a name another service uses for something else)
  aliases       more spellings of the flag, on the class's own command line only
  choices       the values allowed (a Literal annotation gives them too)
  default_text  how a default_factory default reads in --help and docs/cli.md
  prefix, skip  (a field whose type is a config dataclass, e.g. the router's settings inside
                the tokenizer's) its flags join the parent's, named `prefix` + their own name,
                but for the fields in `skip`
A class attribute `flag_prefix` starts every flag name of its class (SimConfig: --sim-*);
`flag_env = False` gives its flags no variables (a tool's options, not a service's); and
a classmethod `from_flags(**values)`, when a class has one, builds it from the values given
(the class itself is called otherwise): it may repair values that depend on each other, but
must build the very config the values give whenever they make a valid one (config_argv
relies on it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from shared.config_types import Converter, converter, parse_size, show
from shared.env import PREFIX

__all__ = ["Flag", "add_config_flags", "build_config", "config_argv", "config_flags",
           "config_from_args", "flag_spec", "parse_config", "parse_size"]  # fmt: skip

_NO_ENV = object()  # metadata "env" absent (None means: no variable)
_FLAGS: weakref.WeakKeyDictionary[argparse.Action, Flag] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Flag:
    """One field's flag: `name` is its dest, --flag and CONVEYOR_<NAME>; `path` the field names
    from the root config down to it."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    convert: Converter
    owner: type
    envs: tuple[str, ...]
    aliases: tuple[str, ...]

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def internal(self) -> bool:
        return bool(self.field.metadata.get("internal"))

    @property
    def has_default(self) -> bool:
        return self.field.default is not dataclasses.MISSING

    @property
    def default_text(self) -> str:
        """The default as --help and the docs show it."""
        if self.has_default:
            return show(self.field.default)
        if self.field.default_factory is not dataclasses.MISSING:
            return str(self.field.metadata.get("default_text", "computed"))
        return "required"

    @property
    def help(self) -> str:
        """The field's help text, then its default (and its variable when not CONVEYOR_<NAME>)."""
        text = f"default {self.default_text}" + (
            " ('none' for None)" if self.convert.nullable else ""
        )
        if self.envs != (self.name.upper(),) and getattr(self.owner, "flag_env", True):
            names = " or ".join(PREFIX + e for e in self.envs)
            text += f"; {names}" if names else "; no variable"
        what = self.field.metadata.get("help")
        return f"{what} ({text})" if what else text


def env_name(field_name: str) -> str:
    """The environment variable (without CONVEYOR_) of a setting named `field_name`."""
    return field_name.upper()


def flag_spec(action: argparse.Action) -> Optional[Flag]:
    """The field behind a flag that `add_config_flags` made (None for a hand-written flag)."""
    return _FLAGS.get(action)


def config_flags(
    cls: type, skip: Iterable[str] = (), only: Optional[Iterable[str]] = None
) -> list[Flag]:
    """Every flag of config class `cls` (nested config fields expanded), but for the fields in
    `skip` (or, when given, outside `only`)."""
    return _walk(cls, (), "", tuple(skip), None if only is None else tuple(only), top=True)


def _walk(
    cls: type, path: tuple[str, ...], prefix: str, skip: tuple, only: Optional[tuple], top: bool
) -> list[Flag]:
    hints = _hints(cls)
    out: list[Flag] = []
    own = getattr(cls, "flag_prefix", "")  # for names of its own; `flag` metadata is as given
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip or (only is not None and f.name not in only):
            continue
        hint = hints[f.name]
        if _is_config(hint):
            inner = (f.metadata.get("prefix", ""), tuple(f.metadata.get("skip", ())))
            out += _walk(hint, (*path, f.name), prefix + own + inner[0], inner[1], None, top=False)
            continue
        convert = converter(hint, f.metadata.get("choices"), byte_size=_is_size(f.name))
        if convert is None:
            continue  # a field no command line can express (a stream, a mapping)
        name = prefix + f.metadata.get("flag", own + _base_name(f.name))
        envs = f.metadata.get("env", _NO_ENV)
        envs = (env_name(name),) if envs is _NO_ENV else _names(envs)
        envs = envs if getattr(cls, "flag_env", True) else ()
        aliases = tuple(f.metadata.get("aliases", ())) if top else ()
        out.append(Flag(name, (*path, f.name), f, convert, cls, envs, aliases))
    return out


def add_config_flags(
    parser: Any, cls: type, skip: Iterable[str] = (), only: Optional[Iterable[str]] = None
) -> list[str]:
    """Add one flag per field of dataclass `cls` (a group per class); returns their names."""
    groups: dict[type, Any] = {}
    flags = config_flags(cls, skip, only)
    for flag in flags:
        if flag.owner not in groups:
            title = flag.owner.__name__
            if getattr(flag.owner, "flag_env", True):
                title += f" (flag, else {PREFIX}<FLAG NAME>, else default)"
            groups[flag.owner] = parser.add_argument_group(title)
        _add_flag(groups[flag.owner], flag)
    return [flag.name for flag in flags]


def _add_flag(group: Any, flag: Flag) -> None:
    hidden = flag.internal
    kind = flag.convert.kind
    action = group.add_argument(
        flag.option,
        *flag.aliases,
        dest=flag.name,
        type=flag.convert.one,
        choices=flag.convert.choices,
        default=argparse.SUPPRESS,  # absent: the variable, else the dataclass default
        metavar=None if flag.convert.choices else flag.name.upper(),
        help=argparse.SUPPRESS if hidden else flag.help,
        # a bool: `--flag` alone means true, `--flag false` too, `--no-flag` as well;
        # a list: comma-separated, and the flag may be repeated
        **({"nargs": "?", "const": True} if kind == "switch" else {}),
        **({"action": _Extend} if kind == "list" else {}),
    )
    _FLAGS[action] = flag
    if kind == "switch":
        negative = group.add_argument(
            "--no-" + flag.option[2:],
            dest=flag.name,
            action="store_false",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS if hidden else f"{flag.option} false",
        )
        _FLAGS[negative] = flag


class _Extend(argparse.Action):
    """A list flag: each occurrence adds its comma-separated items (the first replaces the
    environment's, which is read later)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, tuple(getattr(namespace, self.dest, ())) + tuple(values))


def build_config(
    cls: type,
    args: argparse.Namespace,
    env: Optional[Mapping[str, str]] = None,
    skip: Iterable[str] = (),
    only: Optional[Iterable[str]] = None,
) -> Any:
    """`cls` from parsed flags, else the variables of `env` (default: ours), else defaults.
    Raises ValueError on a bad variable or an invalid config."""
    env = os.environ if env is None else env
    given = vars(args)
    values: dict[tuple[str, ...], Any] = {}
    for flag in config_flags(cls, skip, only):
        if flag.name in given:
            values[flag.path] = given[flag.name]
        elif (raw := _env_value(flag, env)) is not None:
            values[flag.path] = _from_env(flag, *raw)
        elif not flag.has_default and flag.field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{flag.option} is required")
    return _assemble(cls, values, ())


def config_from_args(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    cls: type,
    skip: Iterable[str] = (),
    only: Optional[Iterable[str]] = None,
) -> Any:
    """Build `cls` from the parsed flags; an invalid value exits like any bad flag."""
    try:
        return build_config(cls, args, skip=skip, only=only)
    except ValueError as exc:
        parser.error(str(exc))


def parse_config(cls: type, argv: list[str], env: Optional[Mapping[str, str]] = None) -> Any:
    """`cls` from a command line of its flags alone (ValueError when invalid): tests and tools
    that hold settings as flags."""
    parser = _Raising(prog=cls.__name__, add_help=False)
    add_config_flags(parser, cls)
    return build_config(cls, parser.parse_args(argv), env)


def config_argv(config: Any, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The flags that rebuild `config` in a process whose environment is `env` (default: ours):
    a field's flag when its value is not the default, or when one of its variables is set there
    (the process would read that instead). `parse_config(type(c), config_argv(c, e), e) == c`."""
    env = os.environ if env is None else env
    argv: list[str] = []
    for flag in config_flags(type(config)):
        value = config
        for name in flag.path:
            value = getattr(value, name)
        if flag.has_default and value == flag.field.default and _env_value(flag, env) is None:
            continue
        argv += [flag.option, flag.convert.text(value)]
    return argv


def _assemble(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if f.init and _is_config(hints[f.name]):
            kwargs[f.name] = _assemble(hints[f.name], values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    try:
        return getattr(cls, "from_flags", cls)(**kwargs)
    except TypeError as exc:  # a value of the wrong kind for the class
        raise ValueError(f"{cls.__name__}: {exc}") from None


def _env_value(flag: Flag, env: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """(variable, its text) of the first of the flag's variables set (and not empty)."""
    for name in flag.envs:
        raw = env.get(PREFIX + name)
        if raw:
            return PREFIX + name, raw
    return None


def _from_env(flag: Flag, name: str, raw: str) -> Any:
    try:
        value = flag.convert.parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None
    allowed = flag.convert.choices
    items = value if flag.convert.kind == "list" else (value,)
    if allowed is not None and any(v not in allowed for v in items):
        raise ValueError(f"{name}={raw!r}: not one of {', '.join(map(str, allowed))}")
    return value


def _names(envs: Any) -> tuple[str, ...]:
    if envs is None:
        return ()
    return (envs,) if isinstance(envs, str) else tuple(envs)


def _base_name(field_name: str) -> str:
    """A field's own flag name: seconds fields (`*_s`) drop the unit."""
    return field_name.removesuffix("_s") if field_name.endswith("_s") else field_name


def _is_size(field_name: str) -> bool:
    return field_name.endswith(("_memory", "_bytes"))


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Raising(argparse.ArgumentParser):
    """A parser whose errors are ValueErrors (parse_config), not an exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(message)
