"""Qwen3's tool calls (and Hermes-style templates'): a JSON object in <tool_call> tags, one per call.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Arguments are the model's own JSON text, streamed as it comes (the object's braces matched outside strings),
so the client gets the model's bytes. A region whose JSON does not parse once it closes is content.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

from ladle.entrypoints.openai.chat.tool_parsers.base import CallProgress, TaggedFormat, Tools
from ladle.entrypoints.openai.chat.tool_parsers.json_calls import json_calls
from ladle.structured_output.grammar import DEFAULT_WHITESPACE
from ladle.structured_output.property_names import rewrite_property_names
from ladle.structured_output.schema_refs import relocate

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


# A whole JSON string, or a bracket, or a quote whose string has not closed: strings are skipped in one match.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]"]')  # unrolled: no backtracking per character


def object_end(text: str, start: int) -> int | None:
    """Where the JSON value at text[start] (an object or array) ends: the index past its closing bracket, or None
    while it is open. Brackets inside strings do not count. The scan runs in the regex engine (a whole string is
    one match), since streaming calls it on every delta of arguments that may hold a whole file."""
    depth = 0
    for m in _TOKENS.finditer(text, start):
        token = m.group()
        if token == '"':
            return None  # a string still open: so is the value
        if token[0] != '"':
            depth += 1 if token in "{[" else -1
            if depth == 0:
                return m.end()
    return None


class HermesFormat(TaggedFormat):
    name = "hermes"
    start, end = START, END

    def progress(self, region: str, tools: Tools, final: bool) -> list[CallProgress] | None:
        body, closed = self.body(region)
        if closed or final:  # whole: the object must parse
            try:
                call = json.loads(body)
            except ValueError:
                return None
            args = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
                return None
            m = _ARGS_KEY.search(body)
            raw = body[m.end():object_end(body, m.end())] if m and body[m.end():m.end() + 1] == "{" else None
            # The model's own text when it is the object's; else the object written out again.
            text = raw if raw is not None and _same(raw, args) else json.dumps(args, ensure_ascii=False)
            return [CallProgress(call["name"], text, True)]
        m = _NAME.match(body)
        if m is None:  # not readable yet (or never: then it is content once the region closes)
            return []
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        a = _ARGS_KEY.match(body, m.end())
        if a is None or body[a.end():a.end() + 1] != "{":
            return [CallProgress(name, "", False)]
        end = object_end(body, a.end())
        return [CallProgress(name, body[a.end():end] if end is not None else body[a.end():], False)]

    def grammar(self, tools: Tools, parallel: bool, grammars: Mapping[str, str] | None = None) -> str:
        if grammars:
            calls, rules = json_calls(tools, grammars, "arguments")
            head = 'start: call ("\\n" call)*' if parallel else "start: call"
            return "\n".join([head, f'call: "{START}\\n" ({calls}) "\\n{END}"', *rules])
        call = f'"{START}\\n" %json {json.dumps(calls_schema(tools, "arguments"))} "\\n{END}"'
        return f'start: call ("\\n" call)*\ncall: {call}' if parallel else f"start: {call}"


def calls_schema(tools: Tools, key: str) -> dict:
    """{"name": <a tool's name>, key: <its parameters>}: one call of any of the tools, as one JSON schema. Each
    tool's parameters sit at /anyOf/<i>/properties/<key>, and their local refs move there with them;
    propertyNames is said in keywords llguidance implements where it can be."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, key: relocate(
        rewrite_property_names(params), f"/anyOf/{i}/properties/{key}") or {"type": "object"}},
        "required": ["name", key],
        "additionalProperties": False} for i, (name, params) in enumerate(tools.items())]
    return {"anyOf": calls, "x-guidance": {"whitespace_pattern": DEFAULT_WHITESPACE}}


def _same(raw: str, args: dict) -> bool:
    try:
        return json.loads(raw) == args
    except ValueError:
        return False
