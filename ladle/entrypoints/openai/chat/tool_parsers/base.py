"""What every tool-call parser shares: the calls and deltas it produces, the format interface each model
family implements, and the one streaming driver that runs every format, whole outputs and deltas alike.

A format names the text that opens a tool-call region and reports, for a region seen so far, each call's
progress: its name once known, the JSON text of its arguments so far (only ever growing), and whether it is
done. The driver (ToolStream) holds back any text that may still become a region's opening, emits content
before it, and turns each call's progress into OpenAI's deltas: the name first (with the call's id), then the
arguments in pieces. A whole output is the same driver fed once, so streamed and whole parses always agree. A
region the format cannot read becomes content again, unless part of a call went out already.
"""
from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

Tools = dict[str, dict[str, Any]]  # a request's functions: name -> JSON schema of its parameters


class UnsupportedSchema(ValueError):
    """A tool's parameters that a format cannot hold a forced call to; the message names the tool, the parameter
    and why."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text of an object
    id: str = field(default_factory=new_call_id)


@dataclass
class ToolCallDelta:
    index: int  # the call's place among this output's calls
    id: str | None = None  # with the name, on the call's first delta only
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class CallProgress(NamedTuple):
    name: str | None  # None until the whole name is known
    arguments: str  # the JSON text of the arguments so far: a prefix of the final text
    done: bool


class ToolFormat(ABC):
    """One model family's tool-call syntax."""

    name: str
    start: str  # the text that opens a tool-call region

    @abstractmethod
    def region_end(self, region: str) -> int | None:
        """Where the region (which starts with `start`) ends: the index just past it, or None while it goes on."""

    @abstractmethod
    def progress(self, region: str, tools: Tools, final: bool) -> list[CallProgress] | None:
        """The calls in a region seen so far (final: nothing more will come, so a call its closing text never
        reached may still be read whole); None when the region cannot be read as calls."""

    @abstractmethod
    def grammar(self, tools: Tools, parallel: bool, grammars: Mapping[str, str] | None = None) -> str:
        """A Lark grammar (llguidance) whose every output is one call (several with parallel) of these tools in
        this format, with arguments valid against each schema: tool_choice "required" or a named function. Tags
        are spelled as text: a tag the tokenizer has as one plain added token matches that token (see
        ladle.structured_output.matcher.tokenizer_spec). grammars: the custom tools whose one string parameter
        (json_calls.INPUT) is held to a Lark grammar, by name. UnsupportedSchema where the format cannot hold a
        call to a schema or a grammar."""


class TaggedFormat(ToolFormat):
    """A format whose every call is one region between an opening and a closing tag (Qwen's <tool_call>)."""

    end: str  # the closing tag

    def region_end(self, region: str) -> int | None:
        i = region.find(self.end, len(self.start))
        return None if i < 0 else i + len(self.end)

    def body(self, region: str) -> tuple[str, bool]:
        """The region between its tags, and whether the closing tag came."""
        body = region[len(self.start):]
        closed = body.endswith(self.end)
        return (body[:-len(self.end)] if closed else body), closed


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag (text that may still become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """One choice's output, fed as text deltas: content and tool-call deltas out."""

    def __init__(self, fmt: ToolFormat, tools: Tools) -> None:
        self.fmt, self.tools = fmt, tools
        self.calls: list[ToolCall] = []  # every call begun (name known), in order
        self._pending = ""  # text not yet settled: a possible region start, or whitespace after calls
        self._region: str | None = None
        self._read_at = 0  # the region's length when it was last read
        self._sent: list[tuple[int, int]] = []  # per call of the current region: (call index, arguments sent)

    def feed(self, text: str, force: bool = False) -> ParsedDelta:
        """force: read the region now even if it grew little since its last read (the output's end)."""
        out = ParsedDelta()
        self._pending += text
        while True:
            if self._region is None:
                i = self._pending.find(self.fmt.start)
                if i < 0:
                    keep = partial_suffix(self._pending, self.fmt.start)
                    out.content += self._settle(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                out.content += self._settle(self._pending[:i])
                self._region, self._pending, self._sent, self._read_at = self._pending[i:], "", [], 0
            else:
                self._region += self._pending
                self._pending = ""
                # Inside a call, its region is read again once it grew by a sixteenth: every read scans it
                # whole, so reading it on every delta would cost the square of a long call's arguments (a file
                # the agent writes), this a bounded multiple of their length; a short call is still read on
                # every delta, and until a call has begun every delta is read.
                if not force and self._sent and len(self._region) - self._read_at < len(self._region) // 16:
                    return out
            self._read_at = len(self._region)
            end = self.fmt.region_end(self._region)
            region = self._region if end is None else self._region[:end]
            out += self._advance(region, final=end is not None)
            if end is None:
                return out
            self._pending, self._region = self._region[end:], None

    def finish(self) -> ParsedDelta:
        """The output ended: settle what was held back (a region never closed is read as it stands)."""
        out = self.feed("", force=True)
        if self._region is not None:
            out += self._advance(self._region, final=True)
            self._region = None
        out.content += self._settle(self._pending, final=True)
        self._pending = ""
        return out

    def _settle(self, text: str, final: bool = False) -> str:
        """Content to send: after calls, whitespace alone waits (a separator between calls is not content)."""
        if self.calls and not text.strip():
            return ""
        return text

    def _advance(self, region: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        calls = self.fmt.progress(region, self.tools, final)
        if calls is None:
            if final and not self._sent:  # nothing of it went out: it was text after all
                out.content += region
            return out
        for j, call in enumerate(calls):
            if call.name is None:
                break  # a later call never starts before an earlier one has its name
            if j == len(self._sent):
                self.calls.append(ToolCall(call.name, ""))
                self._sent.append((len(self.calls) - 1, 0))
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, call.name))
            index, sent = self._sent[j]
            if len(call.arguments) > sent and call.arguments.startswith(self.calls[index].arguments):
                piece = call.arguments[sent:]
                self.calls[index].arguments = call.arguments
                self._sent[j] = (index, len(call.arguments))
                if out.tool_calls and out.tool_calls[-1].index == index:
                    out.tool_calls[-1].arguments += piece
                else:
                    out.tool_calls.append(ToolCallDelta(index, arguments=piece))
        return out


def parse_whole(fmt: ToolFormat, text: str, tools: Tools) -> tuple[str, list[ToolCall]]:
    """A whole output: its content and calls (the streaming driver fed once)."""
    stream = ToolStream(fmt, tools)
    out = stream.feed(text)
    out += stream.finish()
    return out.content, stream.calls
