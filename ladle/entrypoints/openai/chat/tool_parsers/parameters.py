"""A tool's parameters as the tag formats (qwen3_coder, deepseek_v4) write them: one tag per parameter, each
value on its own, strings as raw text. Each parameter's schema is read with its own ref followed (pydantic's and
zod's nested models are refs into $defs, and a whole parameters object may be one); what one tag per parameter
or raw text cannot hold a forced call to is an UnsupportedSchema, a 400 that names the tool and parameter.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.base import UnsupportedSchema
from ladle.structured_output.property_names import rewrite_property_names
from ladle.structured_output.schema_refs import deref

# The types a parameter's raw text is read as text (vLLM's names for them, besides JSON's "string").
STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
# Keywords of the parameters object that one tag per parameter cannot hold a call to.
_OBJECT_KEYWORDS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "enum", "const", "minProperties",
                    "maxProperties", "propertyNames", "patternProperties", "dependentRequired", "dependentSchemas",
                    "dependencies", "unevaluatedProperties", "$ref")
# Keywords that constrain a string and that raw text cannot be held to (keywords for other types never apply to
# a string, and unknown ones constrain nothing, as in response_format).
_NOT_RAW = ("format", "not", "allOf", "if", "then", "else")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "enum", "const", *_NOT_RAW)


@dataclass(frozen=True)
class Parameters:
    root: dict[str, Any]  # the parameters schema as sent: every ref in `properties` resolves against it
    top: dict[str, Any]  # the root with its own ref followed (zod's {"$ref": "#/definitions/Args", ...})
    properties: dict[str, Any]  # each parameter's schema, its own ref followed
    required: frozenset[str]


def parameters(params: Any) -> Parameters:
    root = params if isinstance(params, dict) else {}
    top = deref(root, root)
    props = top.get("properties")
    props = props if isinstance(props, dict) else {}
    required = top.get("required")
    return Parameters(root, top, {k: deref(v, root) for k, v in props.items()},
                      frozenset(r for r in required if isinstance(r, str)) if isinstance(required, list) else
                      frozenset())


def unsupported(fmt: str, tool: str, parameter: str | None, reason: str) -> UnsupportedSchema:
    where = f"tool {tool!r}" + (f", parameter {parameter!r}" if parameter is not None else "")
    return UnsupportedSchema(f"{where}: {reason}; the {fmt} tool-call format cannot hold a forced call "
                             "(tool_choice \"required\" or a named tool) to this schema")


def refuse_grammars(fmt: str, grammars: Any) -> None:
    """A tag format writes a custom tool's input as raw text that ends at its closing tag, which a Lark grammar
    (whose text may hold that tag) cannot be held out of."""
    if grammars:
        raise UnsupportedSchema(f"tool {next(iter(grammars))!r}: its input is held to a Lark grammar, and the {fmt} "
                                "tool-call format writes the input as raw text ending at a closing tag the grammar "
                                "cannot be kept from writing; a forced call to it cannot be held to the grammar "
                                "(send tool_choice \"auto\", or a regex format)")


def writable(fmt: str, tool: str, params: Any) -> Parameters:
    """The tool's parameters, checked for what one tag per parameter can write: an object whose properties each
    stand alone (no keywords over the whole object, every required parameter with a schema), with propertyNames
    said in keywords llguidance implements where it can be."""
    p = parameters(rewrite_property_names(params))
    bad = [k for k in _OBJECT_KEYWORDS if k in p.top]
    if bad:
        raise unsupported(fmt, tool, None, f"{', '.join(json.dumps(k) for k in bad)} over the whole parameters "
                          "object (it writes each parameter on its own)")
    kind = p.top.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise unsupported(fmt, tool, None, f"the parameters are of type {json.dumps(kind)}, not an object")
    missing = sorted(p.required - p.properties.keys())
    if missing:
        raise unsupported(fmt, tool, missing[0], "required, but without a schema in properties")
    return p


def may_be_string(schema: Any) -> bool:
    """Whether a (dereferenced) schema allows some string."""
    if not isinstance(schema, dict):
        return schema is not False
    t = schema.get("type")
    if isinstance(t, str):
        return t.strip().lower() in STRING_TYPES
    if isinstance(t, list):
        return any(isinstance(x, str) and x.strip().lower() in STRING_TYPES for x in t)
    if isinstance(schema.get("enum"), list):
        return any(isinstance(v, str) for v in schema["enum"])
    return "const" not in schema or isinstance(schema["const"], str)


def raw_regex(schema: Any, stops: tuple[str, ...]) -> str:
    """A Lark expression for the raw text of a value read as a string: its enum or const (a value holding one of
    stops, the tags that end a value, left out); its pattern, anchors dropped, and length bounds; the string
    alternatives of an anyOf or oneOf. Free text never holds '<' (it could forge its own closing tag, and a
    terminal that allows '<' would need lookahead). UnsupportedSchema (the reason) for what raw text cannot be
    held to: a format, a not, a keyword over alternatives."""
    if not isinstance(schema, dict):
        if schema is False:
            raise UnsupportedSchema("its schema is false: no value is valid")
        schema = {}
    for key in ("anyOf", "oneOf"):
        if key in schema:
            extra = [k for k in (*_STRING_KEYWORDS, "anyOf", "oneOf") if k in schema and k != key]
            if extra or not isinstance(schema[key], list):
                raise UnsupportedSchema(f"raw text cannot be held to {json.dumps(key)} beside "
                                        f"{', '.join(json.dumps(k) for k in extra) or 'a non-list value'}")
            alts = [a for a in schema[key] if may_be_string(a)]
            if not alts:
                raise UnsupportedSchema(f"it is written as raw text, and none of its {key} alternatives is a string")
            if key == "oneOf" and len(alts) > 1:
                raise UnsupportedSchema("raw text cannot be held to exactly one of several string alternatives")
            exprs = [raw_regex(a, stops) for a in alts]
            return exprs[0] if len(exprs) == 1 else "(" + " | ".join(exprs) + ")"
    if "$ref" in schema:  # deref left it: it points nowhere, or only back into itself
        raise UnsupportedSchema(f"its $ref {json.dumps(schema['$ref'])} resolves to no schema")
    extra = [k for k in _NOT_RAW if k in schema]
    if extra:
        shown = ", ".join(json.dumps(k) + (f": {json.dumps(schema[k])}" if k == "format" else "") for k in extra)
        raise UnsupportedSchema(f"it is written as raw text, which cannot be held to {shown}")
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (low, 0 if high is None else high)):
        raise UnsupportedSchema("its minLength and maxLength must be whole numbers")
    pattern = schema.get("pattern")
    if "enum" in schema or "const" in schema:
        values = [v for v in (schema["enum"] if isinstance(schema.get("enum"), list) else [schema.get("const")])
                  if isinstance(v, str) and ("const" not in schema or v == schema["const"])]
        values = [v for v in values if low <= len(v) and (high is None or len(v) <= high)
                  and _matches(pattern, v) and not any(s in v for s in stops)]
        if not values:
            raise UnsupportedSchema("none of its enum values can be written as raw text")
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in values) + ")"
    free = f"/[^<]{{{low},{'' if high is None else high}}}/"
    if isinstance(pattern, str):
        rx = "/" + pattern.removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
        return rx if low == 0 and high is None else f"({rx} & {free})"
    return free


def _matches(pattern: Any, value: str) -> bool:
    """Whether value matches a JSON schema pattern (a search, as JSON schema means it)."""
    if not isinstance(pattern, str):
        return True
    try:
        return re.search(pattern, value) is not None
    except re.error as e:
        raise UnsupportedSchema(f"its pattern {json.dumps(pattern)} cannot be read ({e})") from None
