"""The one codec for internal channels: frozen dataclass messages <-> msgpack bytes.

A message is a msgpack map: {"type": <registered tag>, <field>: <value>, ...}. Nested
dataclasses (SamplingParams, NewSequence, ...) are maps without a tag: their type is known from
the field's annotation. Decoding checks every field's type and reports problems as
`DecodeError` with a stable code, never as a crash.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
import typing
from collections.abc import Callable
from typing import Any, Optional, Union

import msgpack

from shared.protocol import engine_channel, kv_channel, worker_channel
from shared.protocol.errors import ErrorCode, short_repr


class DecodeError(ValueError):
    """A frame that is not a valid message. `code` is a stable ErrorCode string."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_Converter = Callable[[Any], Any]

_TYPES: dict[str, type] = {}
_TAGS: dict[type, str] = {}
_FIELDS: dict[type, list[tuple[str, _Converter, _Converter, bool]]] = {}
# Worker-channel fields that default to an empty list or map (or to None) are left out of the
# frame when empty (or None): a steady StepPlan is then a few dozen bytes
# (docs/design/step_contract.md).
_OMIT_EMPTY: dict[type, frozenset[str]] = {}


def register(tag: str, cls: type) -> None:
    """Make `cls` encodable/decodable under `tag` (called at import for every channel)."""
    if tag in _TYPES and _TYPES[tag] is not cls:
        raise ValueError(f"message tag {tag!r} registered twice")
    _TYPES[tag] = cls
    _TAGS[cls] = tag
    _fields_of(cls)


def encode(msg: Any) -> bytes:
    """Serialize a registered message to one frame."""
    cls = type(msg)
    tag = _TAGS.get(cls)
    if tag is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    wire = _to_wire_map(msg)
    wire["type"] = tag
    return msgpack.packb(wire, use_bin_type=True)


def decode(frame: bytes, max_size: Optional[int] = None) -> Any:
    """Parse one frame into its message dataclass, or raise DecodeError."""
    if max_size is not None and len(frame) > max_size:
        raise DecodeError(ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes > {max_size}")
    try:
        wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(
            ErrorCode.MALFORMED_MESSAGE, f"not msgpack: {short_repr(str(exc))}"
        ) from None
    if not isinstance(wire, dict):
        raise DecodeError(ErrorCode.MALFORMED_MESSAGE, "a message must be a msgpack map")
    tag = wire.get("type")
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise DecodeError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {short_repr(tag)}")
    return _from_wire_map(cls, wire, path=str(tag))


# ---- field conversion -------------------------------------------------------------------------


def _identity(v: Any) -> Any:
    return v


def _fields_of(cls: type) -> list[tuple[str, _Converter, _Converter, bool]]:
    cached = _FIELDS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        enc, dec = _converters(hints[f.name])
        out.append((f.name, enc, dec, has_default))
    _FIELDS[cls] = out
    if cls.__module__ == worker_channel.__name__:
        _OMIT_EMPTY[cls] = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default_factory in (list, dict) or f.default is None
        )
    return out


def _to_wire_map(obj: Any) -> dict[str, Any]:
    fields = _fields_of(type(obj))
    omit = _OMIT_EMPTY.get(type(obj))
    if not omit:
        return {name: enc(getattr(obj, name)) for name, enc, _, _ in fields}
    wire = {}
    for name, enc, _, _ in fields:
        value = getattr(obj, name)
        if name not in omit or value:
            wire[name] = enc(value)
    return wire


def _from_wire_map(cls: type, wire: Any, path: str) -> Any:
    if not isinstance(wire, dict):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: expected a map")
    kwargs = {}
    for name, _, dec, has_default in _fields_of(cls):
        if name in wire:
            kwargs[name] = dec(wire[name], f"{path}.{name}")
        elif not has_default:
            raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: missing field {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: {exc}") from None


def _converters(hint: Any) -> tuple[_Converter, Callable[[Any, str], Any]]:
    """(encoder, decoder-with-check) for one annotation."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _to_wire_map, lambda v, p: _from_wire_map(hint, v, p)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {hint}")
        enc, dec = _converters(inner[0])
        return (lambda v: None if v is None else enc(v)), (
            lambda v, p: None if v is None else dec(v, p)
        )
    if origin is list:
        enc, dec = _converters(args[0])
        allowed = _primitive_types(args[0])
        if allowed is not None:
            return _identity, lambda v, p: _check_prim_list(v, allowed, p)
        if typing.get_origin(args[0]) is list:  # e.g. block tables: checked in one pass
            inner = _primitive_types(typing.get_args(args[0])[0])
            if inner is not None:
                return _identity, lambda v, p: _check_prim_lists(v, inner, p)
        return (lambda v: [enc(x) for x in v]), (
            lambda v, p: [dec(x, f"{p}[{i}]") for i, x in enumerate(_need(v, list, p))]
        )
    if origin is dict:
        enc, dec = _converters(args[1])
        return (lambda v: {k: enc(x) for k, x in v.items()}), (
            lambda v, p: {
                _need(k, str, p): dec(x, f"{p}[{k}]") for k, x in _need(v, dict, p).items()
            }
        )
    prim = _primitive_check(hint)
    if prim is None:
        raise TypeError(f"unsupported field type {hint}")
    return _identity, lambda v, p: _check_prim(v, prim, p)


def _primitive_check(hint: Any) -> Optional[Callable[[Any], bool]]:
    if hint is Any:
        return lambda v: True
    allowed = _primitive_types(hint)
    return None if allowed is None else (lambda v: type(v) in allowed)


def _check_prim(v: Any, ok: Callable[[Any], bool], path: str) -> Any:
    if not ok(v):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: wrong type {type(v).__name__}")
    return v


# The exact Python types msgpack may decode for each primitive annotation (bool is not int).
_PRIMITIVE_TYPES: dict[Any, frozenset[type]] = {
    bool: frozenset({bool}),
    int: frozenset({int}),
    float: frozenset({float, int}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
}


def _primitive_types(hint: Any) -> Optional[frozenset[type]]:
    """The types allowed for a primitive annotation; None when `hint` is not one."""
    return _PRIMITIVE_TYPES.get(hint)


def _check_prim_list(v: Any, allowed: frozenset[type], path: str) -> list:
    # set(map(type, v)) runs in C: lists of hundreds of rids/tokens are checked in microseconds
    if type(v) is not list or not allowed.issuperset(map(type, v)):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: expected a list of one type")
    return v


def _check_prim_lists(v: Any, allowed: frozenset[type], path: str) -> list:
    # a list of lists of primitives (block tables), checked in C as one flat sequence
    if type(v) is not list or not _LIST_TYPE.issuperset(map(type, v)):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: expected a list of lists")
    if not allowed.issuperset(map(type, itertools.chain.from_iterable(v))):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: expected lists of one type")
    return v


_LIST_TYPE = frozenset({list})


def _need(v: Any, t: type, path: str) -> Any:
    if not isinstance(v, t):
        raise DecodeError(ErrorCode.INVALID_FIELD, f"{path}: expected {t.__name__}")
    return v


def _register_channels() -> None:
    for module in (worker_channel, engine_channel, kv_channel):
        for name in dir(module):
            obj = getattr(module, name)
            if (
                isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and obj.__module__ == module.__name__
            ):
                register(_snake(name), obj)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


_register_channels()
