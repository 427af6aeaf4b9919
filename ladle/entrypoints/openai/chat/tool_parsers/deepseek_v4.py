"""DeepSeek-V4's tool calls (DSML): one block of invokes, each parameter tagged as raw text or JSON.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The model writes the block after "\\n\\n" (DeepSeek's encoder puts content + "\\n\\n" + block), so those blank
lines are framing, not content: the format finds its regions itself (start is "", region_end decides) so that
the whitespace before a block goes into the block's region and the content before it ends where its text does.
(A start of "\\n\\n" + tag would not do: after </think> the reasoning parser drops those lines, and the block
comes bare.) Content streams as it comes; only whitespace waits, until something other than a block follows.
Arguments are JSON built from whole parameters: "{" once the name is known, each parameter as it closes, "}"
at </｜DSML｜invoke>. A string="true" value is raw text (JSON-escaped here); a string="false" value is JSON text
(kept as text when it does not parse, as vLLM does).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.base import (
    CallProgress,
    ToolFormat,
    Tools,
    UnsupportedSchema,
    partial_suffix,
)
from ladle.entrypoints.openai.chat.tool_parsers.parameters import raw_regex, refuse_grammars, unsupported, writable
from ladle.structured_output.grammar import DEFAULT_WHITESPACE
from ladle.structured_output.schema_refs import standalone

D = "\uff5cDSML\uff5c"  # the fullwidth bars (U+FF5C) around DSML, as the tokenizer and the template spell them
BLOCK, BLOCK_END = f"<{D}tool_calls>", f"</{D}tool_calls>"
INVOKE, INVOKE_END = f'<{D}invoke name="', f"</{D}invoke>"
PARAM, PARAM_END = f'<{D}parameter name="', f"</{D}parameter>"
_INVOKE_NAME = re.compile(re.escape(INVOKE) + r'([^"<>\n]*)"')
_PARAM = re.compile(re.escape(PARAM) + r'([^"<>\n]*)" string="(true|false)">')
_WS = re.compile(r"\s*")
_INVOKE_CLOSE = '">\n'  # after the name, in the grammar
BLOCK_OPENING = f"\n\n{BLOCK}\n"  # the block's start as the model writes it
FORMAT = "deepseek_v4"
STRING_VALUE = r"/[^<]*/"  # the grammar's raw text: it cannot hold "<", which would need lookahead to allow


def _skip_ws(text: str, pos: int) -> int:
    """Where the whitespace from pos ends."""
    m = _WS.match(text, pos)
    assert m is not None  # \s* matches the empty string
    return m.end()


class DeepSeekV4Format(ToolFormat):
    name = FORMAT
    start = ""  # every position may open a region: region_end splits content from blocks (see the docstring)

    def region_end(self, region: str) -> int | None:
        j = region.find(BLOCK)
        # Where a block begins or may still begin, with the whitespace before it: content stops there.
        k = len(region[:j if j >= 0 else len(region) - partial_suffix(region, BLOCK)].rstrip())
        if k > 0:
            return k  # content first (a later region holds the block, if one comes)
        if j < 0:
            return None  # whitespace, or the block's tag still coming
        e = region.find(BLOCK_END, j)
        return None if e < 0 else e + len(BLOCK_END)

    def progress(self, region: str, tools: Tools, final: bool) -> list[CallProgress] | None:
        text = region.lstrip()
        if not text.startswith(BLOCK):
            return None  # content (or, not final, a tag still coming: nothing to say yet)
        pos = len(BLOCK)
        calls: list[CallProgress] = []
        while True:
            pos = _skip_ws(text, pos)
            rest = text[pos:]
            if rest.startswith(BLOCK_END):
                break
            m = _INVOKE_NAME.match(text, pos)
            if m is None:
                if _coming(rest, INVOKE, '"') or BLOCK_END.startswith(rest):
                    break  # the next tag (or the name in it) is still coming
                return None
            after = text[m.end():m.end() + 1]  # the invoke tag's ">"
            if not m.group(1) or after not in (">", ""):
                return None
            parsed = _parameters(text, m.end() + 1) if after else ([], len(text), False)
            if parsed is None:
                return None
            parts, pos, closed = parsed
            args = "{" + ", ".join(parts)
            # An invoke the output ended inside is read as it stands (its whole parameters), like hermes reads
            # a call whose closing tag never came.
            calls.append(CallProgress(m.group(1), args + "}" if closed or final else args, closed or final))
            if not closed:
                break
        return None if final and not calls else calls

    def grammar(self, tools: Tools, parallel: bool, grammars: Mapping[str, str] | None = None) -> str:
        refuse_grammars(self.name, grammars)
        # One rule per tool (named by index: a tool's name need not be a Lark name).
        rules = [f"call_{i}: {_lit(INVOKE + name + _INVOKE_CLOSE)} {_params_rule(name, params)}{_lit(INVOKE_END)}"
                 for i, (name, params) in enumerate(tools.items())]
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        body = 'call ("\\n" call)*' if parallel else "call"
        # "\n" apart from the closing tag: as one literal it would begin like the "\n" before another invoke, and
        # llguidance's lexer, taking the longer, would not come back from "\n<" when an invoke follows.
        return "\n".join([f'start: {_lit(BLOCK_OPENING)} {body} "\\n" {_lit(BLOCK_END)}', f"call: {calls}", *rules])


def _parameters(text: str, pos: int) -> tuple[list[str], int, bool] | None:
    """An invoke's whole parameters from pos as '"key": value' JSON pieces, where reading stopped, and whether
    </｜DSML｜invoke> closed it; None when the text cannot be an invoke's body."""
    parts: list[str] = []
    while True:
        pos = _skip_ws(text, pos)
        rest = text[pos:]
        if rest.startswith(INVOKE_END):
            return parts, pos + len(INVOKE_END), True
        m = _PARAM.match(text, pos)
        if m is None:
            if _coming(rest, PARAM, ">") or INVOKE_END.startswith(rest):
                return parts, len(text), False  # a tag still coming
            return None
        e = text.find(PARAM_END, m.end())
        if e < 0:
            return parts, len(text), False  # the value is still coming: only whole parameters go out
        parts.append(f"{json.dumps(m.group(1), ensure_ascii=False)}: {_value(text[m.end():e], m.group(2))}")
        pos = e + len(PARAM_END)


def _value(raw: str, string: str) -> str:
    """A parameter's value as JSON text: raw text for string="true", JSON for string="false" (its text as a
    string when it is not JSON, NaN and Infinity included, which JSON has not)."""
    if string == "false":
        try:
            value = json.loads(raw, parse_constant=_reject)
        except ValueError:
            return json.dumps(raw, ensure_ascii=False)
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except ValueError:  # a number past a float's range (1e400): JSON still, written as it came
            return raw.strip()
    return json.dumps(raw, ensure_ascii=False)


def _reject(name: str) -> Any:
    raise ValueError(name)


def _coming(rest: str, opener: str, close: str) -> bool:
    """Whether rest may still become a tag that begins with opener and whose attributes end at close."""
    return opener.startswith(rest) or (rest.startswith(opener) and close not in rest[len(opener):])


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _params_rule(tool: str, params: Any) -> str:
    """The parameters of one invoke, in the schema's order: required ones always, the rest optional. A string
    parameter is raw text (string="true") where raw text can hold its schema, the rest JSON against their own
    schema (string="false"), refs resolving against the whole parameters. A schema without "properties" (a
    free-form object) takes any parameters; an empty one takes none."""
    p = writable(FORMAT, tool, params)
    items = []
    for key, sub in p.properties.items():
        if sub is False:
            continue  # a parameter no value is valid for: never written
        item = _param(key, sub if isinstance(sub, dict) else {}, p.root)
        items.append(item if key in p.required else f"({item})?")
    extra = p.top.get("additionalProperties", True)
    if "properties" not in p.top and extra is not False:
        if extra not in (True, {}):
            raise unsupported(FORMAT, tool, None, "a schema for parameters it does not name (additionalProperties)")
        any_value = (f'("\\" string=\\"true\\">" {STRING_VALUE} | "\\" string=\\"false\\">" '
                     f'%json {json.dumps(_bounded({}))})')
        items.append(f'({_lit(PARAM)} /[A-Za-z_][A-Za-z0-9_.-]*/ {any_value} {_lit(PARAM_END + chr(10))})*')
    return "".join(f"{i} " for i in items)


def _param(key: str, sub: dict[str, Any], root: dict[str, Any]) -> str:
    value = None
    if sub.get("type") == "string":
        try:
            value = raw_regex(sub, (PARAM_END, BLOCK_END))
        except UnsupportedSchema:
            pass  # a string raw text cannot hold (a format, say): written as JSON, which can
    if value is not None:
        opener = _lit(f'{PARAM}{key}" string="true">')
    else:
        value = f"%json {json.dumps(_bounded(standalone(sub, root)))}"
        opener = _lit(f'{PARAM}{key}" string="false">')
    return f"{opener} {value} {_lit(PARAM_END + chr(10))}"


def _bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with JSON's whitespace bounded (as hermes bounds it): unbounded runs let a model pad forever."""
    return {**schema, "x-guidance": {"whitespace_pattern": DEFAULT_WHITESPACE}}
