"""Qwen3.5's and Qwen3-Coder's tool calls (vLLM's `qwen3_coder`): XML-ish tags with raw, unquoted values.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parallel calls are joined by "\\n"; one "\\n" after a parameter's `>` and one before its `</parameter>` are framing.
Values carry no JSON types, so each is typed with the request's schema of that parameter (vLLM's
`_convert_param_value` rules). Arguments are streamed one parameter at a time, once it is complete (as vLLM does):
the JSON text of a value is only known when the value is, and the arguments text must only ever grow.
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.base import (
    CallProgress,
    TaggedFormat,
    Tools,
    UnsupportedSchema,
    partial_suffix,
)
from ladle.entrypoints.openai.chat.tool_parsers.parameters import (
    STRING_TYPES,
    parameters,
    raw_regex,
    refuse_grammars,
    unsupported,
    writable,
)
from ladle.structured_output.grammar import DEFAULT_WHITESPACE
from ladle.structured_output.schema_refs import NON_CONSTRAINING, standalone

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
# A name with any of these is a phantom call (prose about the format), not one to run (vLLM rejects the same).
_BAD_NAME = re.compile(r"""[\s{}<>"']""")

_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_BOOL_TYPES = {"boolean", "bool", "binary"}
# What a raw value may not hold: the tags that end it, or its call.
_STOPS = (PARAM_END, PARAM, FUNC_END, END)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def param_type(schema: Any) -> str:
    """The type a parameter's value is read as: its schema's type (the first non-null one of a list; else of its
    enum's values when they share one; else of an anyOf, oneOf or allOf member), "string" when it names none
    (vLLM's reading: raw text is the safe default). The schema's own ref is followed first (see parameters)."""
    return _declared(schema) or "string"


def _declared(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null" if t else None)
    if t is not None:
        return str(t).strip().lower()
    values = _values(schema)
    if values is not None:
        kinds = {_json_type(v) for v in values} - {"null"}
        if kinds and kinds <= {"integer", "number"}:
            return "integer" if kinds == {"integer"} else "number"
        if len(kinds) <= 1:
            return kinds.pop() if kinds else "null"
    for alt in [*(schema.get("anyOf") or schema.get("oneOf") or []), *(schema.get("allOf") or [])]:
        t = _declared(alt)
        if t not in (None, "null"):
            return t
    return None


def _values(schema: dict[str, Any]) -> list[Any] | None:
    """The values an enum or const allows (None: it has neither)."""
    if isinstance(schema.get("enum"), list):
        return [v for v in schema["enum"] if "const" not in schema or _same_value(v, schema["const"])]
    return [schema["const"]] if "const" in schema else None


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # JSON's equality: true is not 1


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _nullable(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    values = _values(schema)
    return t == "null" or (isinstance(t, list) and "null" in t) or any(
        isinstance(a, dict) and a.get("type") == "null" for a in schema.get("anyOf") or schema.get("oneOf") or []) or (
        t is None and values is not None and None in values)


def _admits(schema: dict[str, Any], value: Any) -> bool:
    """Whether the schema's enum and const allow value."""
    values = _values(schema)
    return values is None or any(_same_value(v, value) for v in values)


def convert(value: str, schema: Any) -> Any:
    """A raw value typed by its parameter's schema (None: an unknown parameter). Whatever cannot be read as that
    type stays the raw string, so a call is never lost to a typing slip."""
    if schema is None:
        return value
    t = param_type(schema)
    # The Qwen3.5 template renders Python's None as "None", so history and the model both write it.
    if value.strip().lower() in ("null", "none") and (t not in STRING_TYPES or _nullable(schema)):
        return None
    try:
        if t in STRING_TYPES:
            return value
        if t.startswith(_INT_PREFIXES):
            return int(value)
        if t.startswith(("num", "float")):
            f = float(value)
            if not math.isfinite(f) and not _JSON_NUMBER.fullmatch(value.strip()):  # NaN and Infinity are not JSON
                return value
            return int(f) if f.is_integer() else f  # (1e400 is: an inf that _member writes as its text)
        if t in _BOOL_TYPES:
            return value.strip().lower() == "true"
        if t in ("object", "array", "arr") or t.startswith(("dict", "list")):
            try:
                return json.loads(value)
            except ValueError:
                pass
        out = ast.literal_eval(value.strip())  # Python literals: the template writes True, None, {'a': 1}
        json.dumps(out, allow_nan=False)  # a set, bytes or 1e400 has no JSON: keep the text
        return out
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError):
        return value


def _unframe(value: str) -> str:
    """One "\\n" after `>` and one before the closing tag are the format's, not the value's."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3XmlFormat(TaggedFormat):
    name = "qwen3_coder"
    start, end = START, END

    def progress(self, region: str, tools: Tools, final: bool) -> list[CallProgress] | None:
        body, closed = self.body(region)
        final = final or closed
        head = body.lstrip()
        if not head.startswith(FUNC):
            # Still on its way to `<function=`: wait; anything else is not a call (content once it ends).
            return [] if not final and FUNC.startswith(head) else None
        pos = len(body) - len(head) + len(FUNC)
        gt = body.find(">", pos)
        if gt < 0:
            return None if final else []  # the name is not whole: at the end, too little to call anything
        name = body[pos:gt]
        if not name or _BAD_NAME.search(name):
            return None
        props = parameters(tools.get(name)).properties
        parts: list[str] = []
        pos = gt + 1
        while True:
            # Between tags only whitespace is expected; stray text is skipped rather than losing the call.
            p, f = body.find(PARAM, pos), body.find(FUNC_END, pos)
            if f >= 0 and (p < 0 or f < p):
                return [CallProgress(name, _args(parts, True), True)]
            if p < 0:  # no further tag yet: done only if nothing more will come
                return [CallProgress(name, _args(parts, final), final)]
            k = body.find(">", p + len(PARAM))
            if k < 0:
                return [CallProgress(name, _args(parts, final), final)]  # a key cut off at the end is dropped
            key = body[p + len(PARAM):k].strip()
            # A value ends at its `</parameter>`, or (that tag missing) where the next parameter or the function's
            # end begins. Literal tags inside a value therefore end it early; the grammar keeps '<' out of strings.
            ends = [i for i in (body.find(PARAM_END, k + 1), body.find(PARAM, k + 1), body.find(FUNC_END, k + 1))
                    if i >= 0]
            if not ends:
                if not final:
                    return [CallProgress(name, _args(parts, False), False)]
                raw = body[k + 1:]
                # A tag cut off at the end is not the value's.
                raw = raw[:len(raw) - max(partial_suffix(raw, t) for t in (PARAM_END, PARAM, FUNC_END, END))]
                parts.append(_member(key, _unframe(raw), props))
                return [CallProgress(name, _args(parts, True), True)]
            end = min(ends)
            parts.append(_member(key, _unframe(body[k + 1:end]), props))
            pos = end + len(PARAM_END) if body.startswith(PARAM_END, end) else end

    def grammar(self, tools: Tools, parallel: bool, grammars: Mapping[str, str] | None = None) -> str:
        refuse_grammars(self.name, grammars)
        rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
        terminals: list[str] = []
        for i, (name, params) in enumerate(tools.items()):
            p = writable(self.name, name, params)
            body = [_lit(f"{START}\n{FUNC}{name}>\n")]
            for j, (key, schema) in enumerate(p.properties.items()):
                if schema is False:
                    continue  # a parameter no value is valid for: never written
                rule = f"p_{i}_{j}"
                try:
                    value = _value(schema, p.root, rule.upper(), rules, terminals)
                except UnsupportedSchema as e:
                    raise unsupported(self.name, name, key, str(e)) from None
                rules.append(f"{rule}: {_lit(f'{PARAM}{key}>' + chr(10))} {value}")
                body.append(rule if key in p.required else f"{rule}?")
            body.append(_lit(f"{FUNC_END}\n{END}"))
            rules.append(f"call_{i}: {' '.join(body)}")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, *rules, *terminals]) + "\n"


def _member(key: str, raw: str, props: dict[str, Any]) -> str:
    value = convert(raw, props.get(key))
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # JSON with a number past a float's range (1e400): a number still, written as it came
        text = raw.strip()
    return f"{json.dumps(key, ensure_ascii=False)}: {text}"


def _args(parts: list[str], done: bool) -> str:
    return "{" + ", ".join(parts) + ("}" if done else "")


def _lit(text: str) -> str:
    """Text as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _value(schema: Any, root: dict[str, Any], terminal: str, rules: list[str], terminals: list[str]) -> str:
    """A parameter's value and its closing tag. Raw text and the closing tag must be one terminal: llguidance
    lexes greedily, so a separate /[^<]*/ would swallow the framing "\\n" and then fail at '<'."""
    close = _lit(f"\n{PARAM_END}\n")
    t = param_type(schema)
    scalar = _json_scalar(t)
    if t not in ("object", "array") and scalar is None:
        text = raw_regex(schema, _STOPS)
        terminals.append(f"{terminal}: {f'({text} | {_lit(NONE)})' if _nullable(schema) else text} {close}")
        return terminal
    schema = schema if isinstance(schema, dict) else {}
    none = _nullable(schema) and _admits(schema, None)
    if scalar == "boolean" and not set(schema) - NON_CONSTRAINING - {"type", "enum", "const"}:
        # The template renders values with Jinja's |string, so history (and a model that learned from it) spells
        # booleans and null the Python way; the parser reads either spelling.
        alts = [_lit(text) for v in (True, False) if _admits(schema, v) for text in (json.dumps(v), str(v))]
        alts += [_lit("null"), _lit(NONE)] if none else []
        if not alts:
            raise UnsupportedSchema("no boolean is valid for it")
    else:
        # JSON scalars are raw text already, so JSON's grammar with the whole schema is the value's; the type is
        # pinned to the one the parser reads it as. Refs resolve against the whole parameters (standalone).
        sub = schema if scalar is None else {**schema, "type": [scalar, "null"] if none and scalar != "null"
                                             else scalar}
        doc = {**standalone(sub, root), "x-guidance": {"whitespace_pattern": DEFAULT_WHITESPACE}}
        alts = [f"%json {json.dumps(doc, ensure_ascii=False)}"] + ([_lit(NONE)] if scalar == "null" or none else [])
    rules.append(f"{terminal.lower()}_v: {' | '.join(alts)}")
    return f"{terminal.lower()}_v {close}"


NONE = "None"  # the template renders Python's None so, and the parser reads it as null


def _json_scalar(t: str) -> str | None:
    """The JSON type the parser reads a non-string type as (None: it keeps the text, or it is an object/array)."""
    if t == "null":
        return "null"
    if t in _BOOL_TYPES:
        return "boolean"
    if t.startswith(_INT_PREFIXES):
        return "integer"
    return "number" if t.startswith(("num", "float")) else None
