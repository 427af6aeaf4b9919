"""The Responses API's tools as the chat layer serves them, and the model's calls back under the client's names.

- A function is shown as it is.
- A custom tool (free-form input, Codex's apply_patch) is shown as a function of one string parameter, `input`,
  whose value is the tool's raw input: the parameter's description says so, with a Lark grammar's text after
  it, and a regex is the parameter's pattern (anchored: the whole input matches). A forced call holds the input
  to the grammar or regex; a call the model chose (tool_choice auto) is read as written, as a function call's
  arguments are. The call comes back as a custom_tool_call whose input is that string (so far, for a call cut
  off at max_output_tokens; the arguments' text as written, when they are not an object with a string `input`).
- A namespace's tools are shown flattened as `<namespace>.<name>`, the namespace's description before each
  one's own; their calls come back with the tool's own name and the namespace beside it, as OpenAI answers
  (and Codex reads) them, and calls sent back in input are shown under the flattened name again.
- A hosted tool (web_search, file_search, ...: OpenAI runs them) is not shown: none runs here, so the model
  answers as if it chose not to call it. Offering one is a counted no-op (field_policy); tool_choice requiring
  one is a 400 naming it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.json_calls import INPUT
from ladle.entrypoints.openai.protocol_base import OpenAIError, clip
from ladle.entrypoints.openai.responses.protocol import (
    CustomTool,
    FunctionTool,
    GrammarInputFormat,
    HostedChoice,
    HostedTool,
    NamedCustom,
    NamedFunction,
    NamespaceTool,
)

SEPARATOR = "."  # between a namespace and its tool's name, in the name the model is shown
_MAX_NAME = 64  # a function's name, as the chat layer takes it


@dataclass(frozen=True)
class ClientTool:
    """A tool as the client knows it."""
    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class ResponsesTools:
    functions: list[dict[str, Any]] = field(default_factory=list)  # chat tools: what the model is shown
    names: dict[str, ClientTool] = field(default_factory=dict)  # by the name the model is shown
    grammars: dict[str, str] = field(default_factory=dict)  # custom tools' Lark grammars, by the model's name
    hosted: list[str] = field(default_factory=list)  # the hosted tools' types, offered and left out

    def client(self, name: str) -> ClientTool:
        """The client's names for a call the model made (a name it was not shown stays as it is)."""
        return self.names.get(name) or ClientTool(name)

    def chat_choice(self, choice: Any) -> Any:
        """tool_choice as the chat request says it (None: the default); 400 for what cannot be served."""
        if choice is None or choice == "none":
            return choice
        if isinstance(choice, str):
            if not self.functions:
                if choice == "auto":
                    return None  # only hosted tools: nothing the model could call
                why = f" ({', '.join(self.hosted)} run only at OpenAI)" if self.hosted else ""
                raise OpenAIError(400, f"tool_choice 'required' needs a tool this server can call{why}",
                                  code="invalid_value", param="tool_choice")
            return choice
        if isinstance(choice, HostedChoice):
            raise OpenAIError(400, f"tool_choice {choice.type}: a tool OpenAI runs on its side; none runs here, so "
                              "it cannot be required", code="unsupported_parameter", param="tool_choice")
        assert isinstance(choice, (NamedFunction, NamedCustom))
        name = model_name(choice.name, choice.namespace)
        tool = self.names.get(name)
        if tool is None or tool.custom != (choice.type == "custom"):
            known = ", ".join(n for n, t in self.names.items() if t.custom == (choice.type == "custom"))
            raise OpenAIError(400, f"tool_choice names the {choice.type} tool {clip(name)!r}, which is not among "
                              f"the tools ({known or 'none given'})", code="invalid_value", param="tool_choice")
        return {"type": "function", "function": {"name": name}}


def model_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def responses_tools(tools: list[Any] | None) -> ResponsesTools:
    """The request's tools as the model is shown them; 400 for two tools the model would know by one name."""
    out = ResponsesTools()

    def add(i: str, tool: FunctionTool | CustomTool, namespace: NamespaceTool | None) -> None:
        name = model_name(tool.name, namespace.name if namespace else None)
        if name in out.names:
            raise OpenAIError(400, f"tools{i}: a second tool named {name!r}; names must differ (a namespace's tools "
                              f"are known as namespace{SEPARATOR}name)", code="invalid_value", param="tools")
        if len(name) > _MAX_NAME:
            raise OpenAIError(400, f"tools{i}: {clip(name)!r} (the name the model is shown) is longer than the "
                              f"{_MAX_NAME} characters a tool's name may have here", code="invalid_value",
                              param="tools")
        lead = namespace.description if namespace and namespace.description else None
        description = "\n\n".join(d for d in (lead, tool.description) if d) or None
        custom = isinstance(tool, CustomTool)
        out.names[name] = ClientTool(tool.name, namespace.name if namespace else None, custom)
        function = custom_function(tool) if isinstance(tool, CustomTool) else tool.model_dump(
            exclude_none=True, exclude={"type", "name", "description"})
        out.functions.append({"type": "function", "function": {
            "name": name, **({"description": description} if description else {}), **function}})
        grammar = tool.format if isinstance(tool, CustomTool) else None
        if isinstance(grammar, GrammarInputFormat) and grammar.syntax == "lark":
            out.grammars[name] = grammar.definition

    for i, tool in enumerate(tools or []):
        if isinstance(tool, HostedTool):
            out.hosted.append(tool.type)
        elif isinstance(tool, NamespaceTool):
            for j, member in enumerate(tool.tools):
                add(f"[{i}].tools[{j}]", member, tool)
        else:
            add(f"[{i}]", tool, None)
    return out


def custom_function(tool: CustomTool) -> dict[str, Any]:
    """A custom tool's parameters as the model is shown them (see the module's docstring)."""
    fmt = tool.format
    text: dict[str, Any] = {"type": "string"}
    if fmt is None or fmt.type == "text":
        text["description"] = "The tool's input, free text, passed to the tool as written."
    elif fmt.syntax == "regex":
        text["description"] = "The tool's input, text matching the whole pattern, passed to the tool as written."
        text["pattern"] = f"^(?:{fmt.definition})$"
    else:
        text["description"] = ("The tool's input, text in this Lark grammar, passed to the tool as written:\n"
                               f"{fmt.definition}")
    return {"parameters": {"type": "object", "properties": {INPUT: text}, "required": [INPUT],
                           "additionalProperties": False}}


def custom_arguments(input_text: str) -> str:
    """A custom tool's call as the model is shown it in history: the arguments of its one parameter."""
    return json.dumps({INPUT: input_text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote: its `input` string (as far as it goes, for a
    call cut off at max_output_tokens), else the text as written."""
    try:
        value = json.loads(arguments)
    except ValueError:
        stream = InputStream()
        text = stream.feed(arguments)
        return text if stream.pos is not None else arguments
    if isinstance(value, dict) and isinstance(value.get(INPUT), str):
        return _whole_characters(value[INPUT])
    return arguments


def _whole_characters(text: str) -> str:
    """text with each lone half of a surrogate pair (a \\ud800 the model wrote, which UTF-8 cannot carry) as the
    replacement character."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


_HEAD = re.compile(r'\s*\{\s*"' + INPUT + r'"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class InputStream:
    """A custom tool's input decoded as its arguments' JSON text grows (a stream's deltas): what is certain so
    far of the `input` string, when the arguments open with it."""

    def __init__(self) -> None:
        self.pos: int | None = None  # where decoding stands in the arguments text (None: its opening not seen)
        self.done = False  # the string closed, or the arguments are not {"input": "..."}

    def feed(self, arguments: str) -> str:
        if self.done:
            return ""
        if self.pos is None:
            m = _HEAD.match(arguments)
            if m is None:
                self.done = not _could_open(arguments)
                return ""
            self.pos = m.end()
        out, i = [], self.pos
        while i < len(arguments):
            c = arguments[i]
            if c == '"':
                self.done = True
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            step = _escape(arguments, i)
            if step is None:
                break  # cut inside an escape: wait for the rest
            text, i = step
            out.append(text)
        self.pos = i
        return "".join(out)


def _could_open(arguments: str) -> bool:
    """Whether the arguments may still open with {"input": " (they are a prefix of it, whitespace aside)."""
    squeezed = re.sub(r"\s+", "", arguments)
    return f'{{"{INPUT}":"'.startswith(squeezed)


def _escape(text: str, i: int) -> tuple[str, int] | None:
    """The escape at text[i] (a backslash): its character and where it ends; None while it is cut off."""
    if i + 1 >= len(text):
        return None
    e = text[i + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], i + 2
    if e != "u" or i + 6 > len(text):
        return None if e == "u" else (e, i + 2)
    try:
        code = int(text[i + 2:i + 6], 16)
    except ValueError:
        return text[i:i + 6], i + 6
    if 0xD800 <= code < 0xDC00:  # a surrogate pair's first half: the character needs the second
        if i + 12 > len(text):
            return None
        try:
            low = int(text[i + 8:i + 12], 16)
        except ValueError:
            low = -1
        if text[i + 6:i + 8] == "\\u" and 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), i + 12
    # A lone half of a pair is no character (json.loads keeps it; UTF-8 cannot): the replacement character.
    return ("\ufffd" if 0xD800 <= code < 0xE000 else chr(code)), i + 6
