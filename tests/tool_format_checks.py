"""What every tool format's tests check: a whole parse and a stream split at every character give the same
content and calls, a call's name comes once (with its id) before any of its arguments."""
from __future__ import annotations

import json
from typing import Any

from ladle.entrypoints.openai.tool_parsers.base import ToolCall, ToolFormat, ToolStream, Tools, parse_whole


def streamed(fmt: ToolFormat, text: str, tools: Tools) -> tuple[str, list[tuple[str, str]], list[ToolCall]]:
    """The text fed one character at a time: its content, (name, arguments) per call, and the driver's calls."""
    stream = ToolStream(fmt, tools)
    content, args, names, order = "", {}, {}, []
    for piece in [*text, None]:
        d = stream.feed(piece) if piece is not None else stream.finish()
        content += d.content
        for t in d.tool_calls:
            if t.name is not None:
                assert t.index not in names and t.id  # a call's name comes once, with its id, before its arguments
                names[t.index] = t.name
                order.append(t.index)
            assert t.index in names
            args[t.index] = args.get(t.index, "") + t.arguments
    return content, [(names[i], args.get(i, "")) for i in order], stream.calls


def assert_whole_and_streamed_agree(fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, Any]],
                                    tools: Tools) -> None:
    got_content, got_calls = parse_whole(fmt, text, tools)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    s_content, s_calls, stream_calls = streamed(fmt, text, tools)
    assert s_content == content
    assert [(n, json.loads(a)) for n, a in s_calls] == calls
    assert [c.arguments for c in stream_calls] == [c.arguments for c in got_calls]
