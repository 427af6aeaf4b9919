"""The Anthropic Messages API's streamed answer: server-sent events each named by an `event:` line (the anthropic
client drops any without one), and content blocks numbered 0, 1, 2 with no gaps, opened and closed around their
deltas: thinking, text and tool_use in the order the model wrote them."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from ladle.entrypoints.openai.anthropic.thinking_signature import SHOWN, seal
from ladle.entrypoints.openai.chat.output import ChoicePiece
from ladle.entrypoints.openai.protocol import UsageInfo


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def usage(u: UsageInfo) -> dict[str, int]:
    """Anthropic's usage: input_tokens is the part of the prompt the prefix cache did not serve, as Anthropic
    counts it beside cache_read_input_tokens. ladle writes its cache as it computes, at no extra count, so
    cache_creation_input_tokens is 0."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(finish: str | None, matched: int | str | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a choice's finish."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


class BlockWriter:
    """Content blocks as a choice's pieces come. A tool_use block's input goes out whole when the block closes,
    once it parses: the client re-parses the running concatenation of its input_json_delta events as JSON on
    every one, so a piece that is not the start of valid JSON would break it. With omit_thinking (the request's
    thinking.display "omitted") a thinking block has no deltas: its reasoning goes sealed in its signature."""

    def __init__(self, tool_id: Callable[[str], str], omit_thinking: bool = False) -> None:
        self.tool_id = tool_id
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.arguments = ""
        self.reasoning = ""  # an omitted thinking block's, until it closes

    def take(self, piece: ChoicePiece) -> Iterator[str]:
        if piece.reasoning:
            yield from self._open("thinking", {"thinking": "", "signature": ""})
            if self.omit_thinking:
                self.reasoning += piece.reasoning
            else:
                yield self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content and not (self.kind == "tool_use" and not piece.content.strip()):
            yield from self._open("text", {"text": ""})
            yield self._delta({"type": "text_delta", "text": piece.content})
        for t in piece.tool_calls:
            if t.name is not None:
                yield from self._close()
                yield from self._start("tool_use", {"id": self.tool_id(t.id or ""), "name": t.name, "input": {}})
            self.arguments += t.arguments

    def close(self) -> Iterator[str]:
        yield from self._close()

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        if self.kind != kind:
            yield from self._close()
            yield from self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        self.index, self.kind = self.index + 1, kind
        yield event("content_block_start", {"index": self.index, "content_block": {"type": kind, **block}})

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> Iterator[str]:
        if self.kind is None:
            return
        if self.kind == "thinking":
            signature = seal(self.reasoning) if self.omit_thinking else SHOWN
            yield self._delta({"type": "signature_delta", "signature": signature})
            self.reasoning = ""
        elif self.kind == "tool_use":
            try:
                whole = json.loads(self.arguments)
            except ValueError:
                whole = None
            text = self.arguments if isinstance(whole, dict) else "{}"
            yield self._delta({"type": "input_json_delta", "partial_json": text})
            self.arguments = ""
        yield event("content_block_stop", {"index": self.index})
        self.kind = None
