"""The structured-output schema set: 24 varied JSON schemas, each with a prompt and one valid
instance (compact JSON, keys in the schema's order: what the constrained engine writes).

Used by bench/structured_bench.py (validity, cost, compile times), bench/grammar_libs.py (the
library comparison walks each instance's tokens) and the structured-output tests (a subset).
Every string and array is bounded, so a reply fits `MAX_TOKENS` whatever the model picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 160  # enough for the longest reply any schema below allows


@dataclass(frozen=True, slots=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str  # a user message asking for it
    example: Any  # one valid instance


def _s(max_len: int = 16, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_len, **extra}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


CASES: list[SchemaCase] = [
    SchemaCase(
        "person",
        _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        "Describe a person.",
        {"name": "Ada", "age": 36},
    ),
    SchemaCase(
        "city",
        _obj(
            {
                "city": _s(),
                "country": _s(),
                "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
            }
        ),
        "Describe a city.",
        {"city": "Paris", "country": "France", "population": 2100000},
    ),
    SchemaCase(
        "enum_color",
        _obj({"color": {"enum": ["red", "green", "blue"]}}),
        "Pick a color.",
        {"color": "green"},
    ),
    SchemaCase(
        "bool_flag",
        _obj({"answer": {"type": "boolean"}, "reason": _s(24)}),
        "Is the sky blue?",
        {"answer": True, "reason": "Rayleigh scattering"},
    ),
    SchemaCase(
        "tags",
        _obj({"tags": {"type": "array", "items": _s(10), "minItems": 1, "maxItems": 4}}),
        "Give tags for a blog post about cats.",
        {"tags": ["cats", "pets"]},
    ),
    SchemaCase(
        "scores",
        _obj(
            {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 10},
                    "minItems": 2,
                    "maxItems": 5,
                }
            }
        ),
        "Rate three movies from 0 to 10.",
        {"scores": [7, 9, 4]},
    ),
    SchemaCase(
        "nested_address",
        _obj(
            {"name": _s(), "address": _obj({"street": _s(20), "zip": _s(5, pattern="^[0-9]{5}$")})}
        ),
        "Give a name and a US address.",
        {"name": "Bob", "address": {"street": "1 Main St", "zip": "12345"}},
    ),
    SchemaCase(
        "temperature",
        _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}}),
        "What is a warm day's temperature?",
        {"celsius": 28.5},
    ),
    SchemaCase(
        "probability",
        _obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
        "Give a probability.",
        {"p": 0.25},
    ),
    SchemaCase(
        "any_of_id",
        _obj(
            {
                "id": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": 9999},
                        _s(8, pattern="^[a-z]{2,8}$"),
                    ]
                }
            }
        ),
        "Give an id.",
        {"id": 42},
    ),
    SchemaCase(
        "code_pattern",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
        "Give a product code.",
        {"code": "ABC-1234"},
    ),
    SchemaCase(
        "date_pattern",
        _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
        "Give a date.",
        {"date": "2024-05-17"},
    ),
    SchemaCase(
        "optional_fields",
        _obj({"title": _s(20), "subtitle": _s(20)}, required=["title"]),
        "Give a book title.",
        {"title": "Dune"},
    ),
    SchemaCase(
        "list_of_objects",
        _obj(
            {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": _obj(
                        {"name": _s(12), "qty": {"type": "integer", "minimum": 1, "maximum": 99}}
                    ),
                }
            }
        ),
        "List groceries with quantities.",
        {"items": [{"name": "apple", "qty": 3}]},
    ),
    SchemaCase(
        "matrix",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                }
            }
        ),
        "Give a 2x2 matrix.",
        {"rows": [[1, 0], [0, 1]]},
    ),
    SchemaCase(
        "const_version",
        _obj({"version": {"const": "v1"}, "ok": {"type": "boolean"}}),
        "Report status.",
        {"version": "v1", "ok": True},
    ),
    SchemaCase(
        "nullable",
        _obj({"middle_name": {"anyOf": [_s(12), {"type": "null"}]}}),
        "Does Alan Turing have a middle name?",
        {"middle_name": "Mathison"},
    ),
    SchemaCase(
        "event",
        _obj(
            {
                "event": _s(20),
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            }
        ),
        "Plan a meeting.",
        {"event": "standup", "day": "mon", "hour": 9},
    ),
    SchemaCase(
        "rgb",
        _obj(
            {
                "r": {"type": "integer", "minimum": 0, "maximum": 255},
                "g": {"type": "integer", "minimum": 0, "maximum": 255},
                "b": {"type": "integer", "minimum": 0, "maximum": 255},
            }
        ),
        "Give an RGB color.",
        {"r": 255, "g": 128, "b": 0},
    ),
    SchemaCase(
        "deep_nesting",
        _obj({"a": _obj({"b": _obj({"c": _obj({"d": _s(8)})})})}),
        "Fill the nested object.",
        {"a": {"b": {"c": {"d": "deep"}}}},
    ),
    SchemaCase(
        "one_of_shape",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj(
                            {
                                "kind": {"const": "circle"},
                                "radius": {"type": "integer", "minimum": 1, "maximum": 100},
                            }
                        ),
                        _obj(
                            {
                                "kind": {"const": "square"},
                                "side": {"type": "integer", "minimum": 1, "maximum": 100},
                            }
                        ),
                    ]
                }
            }
        ),
        "Describe a shape.",
        {"shape": {"kind": "circle", "radius": 5}},
    ),
    SchemaCase(
        "email_like",
        _obj(
            {
                "email": {
                    "type": "string",
                    "maxLength": 32,
                    "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$",
                }
            }
        ),
        "Give an email address.",
        {"email": "ada@example.com"},
    ),
    SchemaCase(
        "sentiment",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        "Classify: 'I love this phone.'",
        {"label": "positive", "confidence": 0.9},
    ),
    SchemaCase(
        "unique_words",
        _obj({"words": {"type": "array", "items": _s(8), "minItems": 3, "maxItems": 3}}),
        "Give three words.",
        {"words": ["sun", "moon", "star"]},
    ),
]
