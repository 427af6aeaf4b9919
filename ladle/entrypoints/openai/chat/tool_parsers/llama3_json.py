"""Llama 3.x's tool calls (JSON, vLLM's llama3_json): the whole assistant message is the call, no tags.

    {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop", "parameters": {}}

"arguments" is accepted for "parameters"; parallel calls are joined by "; " (vLLM's extension: the official
templates allow one call). A call only counts at the very start of the output (after whitespace or
<|python_tag|>), as vLLM reads it: a reply that explains JSON in prose must stay prose. The driver finds
regions by their opening text and tells the format nothing of the text before, so the format finds its regions
itself (start is ""): the first region is the output's start; a region of content ends just before its last
"mark" character (not whitespace, "{" or "<"), so every later region opens with a mark and can never look like
the start of a call. Content therefore streams one character (plus any trailing whitespace, "{" or "<") behind.

Arguments are the model's own JSON text of the parameters object, streamed as it comes (as hermes streams
them); a call's name goes out only once "parameters" follows it, so a JSON answer that merely has a "name" key
never begins a call. A first object that is not a call is content.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

from ladle.entrypoints.openai.chat.tool_parsers.base import CallProgress, ToolFormat, Tools
from ladle.entrypoints.openai.chat.tool_parsers.hermes import calls_schema, object_end
from ladle.entrypoints.openai.chat.tool_parsers.json_calls import json_calls

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_SEP = re.compile(r"\s*(;)?\s*")
_NOT_MARKS = "{<"  # with whitespace: what a region of content may not end just before (see the docstring)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    start = ""  # every position may open a region: region_end splits content from calls (see the docstring)

    def region_end(self, region: str) -> int | None:
        pos = _first_object(region)
        if pos is None:
            return None  # whitespace, or <|python_tag|> still coming
        if pos < 0:
            return _content_end(region)
        last = None  # the end of the last whole call
        while True:
            e = object_end(region, pos)
            if e is None:
                return None
            if _read(region[pos:e]) is None:  # not a call: content up to the last call (all of it, if none)
                return last if last is not None else e
            m = _SEP.match(region, e)
            assert m is not None  # every part of the pattern may be empty
            if m.end() == len(region):
                return None  # "; " or whitespace so far: another call may follow
            if not (m.group(1) and region[m.end()] == "{"):
                return e  # text after the calls: a later region of content
            pos, last = m.end(), e

    def progress(self, region: str, tools: Tools, final: bool) -> list[CallProgress] | None:
        pos = _first_object(region)
        if pos is None or pos < 0:
            return None if final or pos is not None else []
        calls: list[CallProgress] = []
        while True:
            head = _HEAD.match(region, pos)
            args = head.end() if head is not None and region[head.end():head.end() + 1] == "{" else None
            args_end = object_end(region, args) if args is not None else None
            # While its arguments are open the call is too: one scan of them per delta, not two.
            e = object_end(region, pos) if args is None or args_end is not None else None
            if e is None:  # the last call, still being written (or cut off: then read as it stands)
                call = _partial(region, head, args, args_end, final)
                calls += [call] if call is not None else []
                break
            read = _read(region[pos:e])
            if read is None:
                return calls or None
            calls.append(CallProgress(*read, True))
            m = _SEP.match(region, e)
            assert m is not None  # every part of the pattern may be empty
            if not (m.group(1) and region[m.end():m.end() + 1] == "{"):
                break
            pos = m.end()
        return None if final and not calls else calls

    def grammar(self, tools: Tools, parallel: bool, grammars: Mapping[str, str] | None = None) -> str:
        rules: list[str] = []
        if grammars:
            call, rules = json_calls(tools, grammars, "parameters")
        else:
            call = f"%json {json.dumps(calls_schema(tools, 'parameters'))}"
        head = f"start: call ({json.dumps(SEPARATOR)} call)*\ncall: {call}" if parallel else f"start: {call}"
        return "\n".join([head, *rules])


def _first_object(region: str) -> int | None:
    """Where the region's first call opens: the index of its "{" past whitespace and <|python_tag|>; -1 when the
    region cannot open with a call; None while it may still."""
    i = len(region) - len(region.lstrip())
    if region.startswith(PYTHON_TAG, i):
        i = len(region) - len(region[i + len(PYTHON_TAG):].lstrip())
    elif PYTHON_TAG.startswith(region[i:]):
        return None  # nothing yet, or the tag coming
    if i == len(region):
        return None
    return i if region[i] == "{" else -1


def _content_end(region: str) -> int | None:
    """Just before the region's last mark (past its first character), so the next region opens with a mark;
    None when there is none yet."""
    for k in range(len(region) - 1, 0, -1):
        if not region[k].isspace() and region[k] not in _NOT_MARKS:
            return k
    return None


def _read(obj: str) -> tuple[str, str] | None:
    """A whole object read as a call: its name and the JSON text of its arguments (the model's own text where it
    is that object, else the object written out); None when it is not one."""
    try:
        call = json.loads(obj)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("parameters", call.get("arguments"))
    if not isinstance(args, dict):
        return None
    m = _HEAD.match(obj)
    raw = obj[m.end():object_end(obj, m.end())] if m and obj[m.end():m.end() + 1] == "{" else None
    return call["name"], raw if raw is not None and _same(raw, args) else json.dumps(args, ensure_ascii=False)


def _partial(region: str, head: re.Match[str] | None, args: int | None, args_end: int | None,
             final: bool) -> CallProgress | None:
    """The call an unclosed object has begun: its name once its arguments' object opens (at args), and their
    text so far. At the output's end, a call whose arguments closed (only the outer brace missing) is whole."""
    if head is None or args is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None
    if not final:
        return CallProgress(name, region[args:args_end], False)
    if args_end is None or not isinstance(_loads(region[args:args_end]), dict):
        return None
    return CallProgress(name, region[args:args_end], True)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _same(raw: str, args: dict) -> bool:
    return _loads(raw) == args
