"""What every tool format's tests check: a whole parse and a stream split at every character give the same
content and calls, a call's name comes once (with its id) before any of its arguments."""
from __future__ import annotations

import json
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.base import ToolCall, ToolFormat, ToolStream, Tools, parse_whole


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


def assert_arguments_only_grow(fmt: ToolFormat, region: str, tools: Tools, first: int = 0) -> None:
    """Fed region[:i] for each i from `first`, every call the format reads has its name, and its arguments only
    grow; the final parse ends every call, its arguments a JSON object the last partial ones began."""
    seen: dict[int, list[str]] = {}
    for i in range(first, len(region) + 1):
        got = fmt.progress(region[:i], tools, final=False)
        assert got is not None
        for j, call in enumerate(got):
            past = seen.setdefault(j, [])
            assert call.name and (not past or call.arguments.startswith(past[-1]))
            past.append(call.arguments)
    final = fmt.progress(region, tools, final=True)
    assert final and all(c.done for c in final)
    for j, call in enumerate(final):
        assert call.arguments.startswith(seen[j][-1] if j in seen else "")
        assert isinstance(json.loads(call.arguments), dict)
