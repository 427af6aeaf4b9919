"""JSON schemas for the structured-output tests: every keyword family the issue names (nested objects, arrays
with min/max items, enums, anyOf, bounded numbers, string patterns), each with every path bounded in length, so
a random-weight model (which never writes valid JSON unconstrained) completes each within max_tokens."""
from __future__ import annotations

from typing import Any


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def s(n: int = 6, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": n, **kw}


INT = {"type": "integer", "minimum": -50, "maximum": 50}
PERSON = obj({"name": s(8), "age": {"type": "integer", "minimum": 0, "maximum": 120}})

SCHEMAS: list[dict[str, Any]] = [
    obj({"name": s(8), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}}),
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
    obj({"user": PERSON, "id": {"type": "integer", "minimum": 1, "maximum": 9999}}),
    obj({"team": obj({"lead": PERSON, "members": {"type": "array", "items": PERSON, "maxItems": 2}})}),
    {"anyOf": [s(4), {"type": "integer", "minimum": 0, "maximum": 9}]},
    {"oneOf": [obj({"kind": {"const": "a"}, "x": INT}), obj({"kind": {"const": "b"}, "y": s(3)})]},
    obj({"p": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    {"type": "null"},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4},
    obj({"a": INT, "b": s(3), "c": {"type": "boolean"}}, required=["a"]),
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2},
    obj({"maybe": {"type": ["string", "null"], "maxLength": 5}}),
    {"enum": [1, "one", None, True, 2.5]},
    {"type": "array", "prefixItems": [s(4), INT, {"type": "boolean"}], "items": False, "minItems": 3},
    {"$defs": {"pt": obj({"x": INT, "y": INT})}, **obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}})},
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    {"allOf": [obj({"a": INT, "b": INT}, required=["a"]), {"required": ["b"]}]},
    {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    obj({k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abcdef"}),
    {"enum": ["a fairly long option one", "another long option two", "short"]},
    obj({"id": {"type": "string", "format": "uuid"}}),
    {"anyOf": [obj({"type": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
               obj({"type": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}})]},
    {"type": "array", "items": obj({"tag": {"enum": ["x", "y"]}, "n": INT}), "minItems": 1, "maxItems": 2},
    obj({"t": {"type": "number", "minimum": -1, "maximum": 1}, "u": {"type": "number", "minimum": 10, "maximum": 20}}),
    obj({"nested": obj({"deeper": obj({"deepest": obj({"v": {"enum": [1, 2, 3]}})})})}),
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
]
