"""One chat choice's output read as it comes: its thinking (reasoning_content), its answer and its tool calls,
by the server's reasoning and tool-call parsers. A whole answer is the same reader fed once."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ladle.entrypoints.openai.chat.reasoning_parser import ReasoningStream
from ladle.entrypoints.openai.chat.settings import ChatSettings
from ladle.entrypoints.openai.chat.tool_parsers.base import ToolCall, ToolCallDelta, ToolStream
from ladle.entrypoints.openai.chat.tools import ToolPlan


@dataclass
class ChoicePiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceReader:
    def __init__(self, settings: ChatSettings, plan: ToolPlan, thinking: bool,
                 on_calls: Callable[[int], None] | None = None) -> None:
        """thinking: the prompt left a thinking block open (ReasoningParser.starts_thinking); on_calls: told how
        many calls the choice made, when it ends (the server's /metrics)."""
        self.on_calls = on_calls
        self._reasoning: ReasoningStream | None = (settings.reasoning.stream(thinking) if settings.reasoning
                                                   else None)
        self._tools = (ToolStream(settings.tool_format, plan.tools) if plan.parse and settings.tool_format
                       else None)
        self.reasoning_seen = False

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> ChoicePiece:
        return self._answer(*(self._reasoning.feed(text) if self._reasoning else ("", text)), final=False)

    def finish(self) -> ChoicePiece:
        piece = self._answer(*(self._reasoning.finish() if self._reasoning else ("", "")), final=True)
        if self.on_calls is not None:
            self.on_calls(len(self.calls))
        return piece

    def _answer(self, reasoning: str, answer: str, final: bool) -> ChoicePiece:
        self.reasoning_seen = self.reasoning_seen or bool(reasoning)
        if self._tools is None:
            return ChoicePiece(reasoning, answer)
        d = self._tools.feed(answer)
        if final:
            d += self._tools.finish()
        return ChoicePiece(reasoning, d.content, d.tool_calls)


def read_whole(settings: ChatSettings, plan: ToolPlan, thinking: bool, text: str,
               on_calls: Callable[[int], None] | None = None) -> tuple[ChoicePiece, list[ToolCall]]:
    reader = ChoiceReader(settings, plan, thinking, on_calls)
    piece = reader.feed(text)
    rest = reader.finish()
    return ChoicePiece(piece.reasoning + rest.reasoning, piece.content + rest.content,
                       piece.tool_calls + rest.tool_calls), reader.calls


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's: a choice that stopped after calling tools finished with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason
