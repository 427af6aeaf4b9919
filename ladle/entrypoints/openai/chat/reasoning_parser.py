"""Reasoning parsers: a thinking model's output split into its thinking (reasoning_content) and its answer.

Where the thinking block stands at the start of the output is read from the prompt, the same for every family:
a prompt whose last think tag is an open <think> (Qwen3.5, Qwen3-Thinking, DeepSeek's thinking mode) starts the
output thinking; any other may open a block with its first text (Qwen3's hybrid models write <think>
themselves), else it is all answer. Thinking ends at </think>; an output cut off inside the block is all
thinking (as vLLM's deepseek_r1 parser reads it). Text that may still be part of a tag is held back.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ladle.entrypoints.openai.chat.tool_parsers.base import partial_suffix
from ladle.sampling_params import ThinkTags


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Text that ends thinking without the end tag and begins the answer: Qwen3.5 may open an XML tool call
    # inside its thinking (vLLM's qwen3 parser reads it the same way).
    implicit_end: str | None = None

    def starts_thinking(self, prompt_text: str) -> bool:
        """Whether the prompt leaves a thinking block open for the model."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def gate(self, prompt_text: str) -> str:
        """Where a constrained request starts (ThinkTags.initial): thinking in a block the prompt left open; at
        the grammar when the prompt ends with a closed block (the template turned thinking off for this turn);
        else the model's first token may open a block."""
        if self.starts_thinking(prompt_text):
            return "thinking"
        return "enforced" if prompt_text.rstrip().endswith(self.end) else "may_open"

    def think_tags(self, tokenizer: Any) -> ThinkTags:
        """The tags as the tokenizer encodes them (one token each in the families' real vocabularies)."""
        start, end = (tuple(tokenizer.encode(t, add_special_tokens=False)) for t in (self.start, self.end))
        return ThinkTags(start, end)

    def stream(self, thinking: bool) -> ReasoningStream:
        return ReasoningStream(self, thinking)


PARSERS = {p.name: p for p in (ReasoningParser("qwen3", implicit_end="<tool_call>\n<function="),
                                ReasoningParser("deepseek_v4"))}


class ReasoningStream:
    """One choice's output, fed as text: (reasoning, answer) pieces out."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser = parser
        self.state = "thinking" if thinking else "may_open"
        self._held = ""
        self._fresh = True  # at the start of the thinking text: leading newlines are the tag's, not thought

    def feed(self, text: str) -> tuple[str, str]:
        p, reasoning, answer = self.parser, "", ""
        self._held += text
        while self._held:
            if self.state == "may_open":
                stripped = self._held.lstrip()
                if stripped.startswith(p.start):
                    self.state, self._held = "thinking", stripped[len(p.start):]
                elif p.start.startswith(stripped):
                    return reasoning, answer  # may still become the tag
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                i = self._held.find(p.end)
                j = self._held.find(p.implicit_end) if p.implicit_end else -1
                if i < 0 and j < 0:
                    keep = max(partial_suffix(self._held, tag) for tag in (p.end, p.implicit_end or p.end))
                    reasoning += self._thought(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    return reasoning, answer
                if j >= 0 and (i < 0 or j < i):  # the answer begins at the marker, which is its own text
                    reasoning += self._thought(self._held[:j])
                    self.state, self._held = "answer", self._held[j:]
                    continue
                reasoning += self._thought(self._held[:i])
                self.state, self._held = "answer_start", self._held[i + len(p.end):]
            elif self.state == "answer_start":  # the blank lines after </think> separate, they are not answer
                self._held = self._held.lstrip()
                if self._held:
                    self.state = "answer"
            else:
                answer += self._held
                self._held = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back (a cut-off tag is text of the part it was in)."""
        held, self._held = self._held, ""
        if self.state == "thinking":
            return self._thought(held), ""
        return "", held if self.state in ("may_open", "answer") else held.lstrip()

    def _thought(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip("\n")
            self._fresh = not text
        return text


def thinking_tokens(parser: ReasoningParser, thinking: bool, token_ids: Iterable[int],
                    text_of: Callable[[int], str]) -> int:
    """How many of an output's tokens are its thinking, its tags included (usage's reasoning_tokens): the output
    fed to a reasoning stream token by token, each counted when it finds or leaves the stream thinking. A count
    of generated tokens, so never more than the output has (decoded text, encoded again, could be)."""
    stream = parser.stream(thinking)
    count = 0
    for token_id in token_ids:
        before = stream.state
        stream.feed(text_of(token_id))
        count += before == "thinking" or stream.state == "thinking"
    return count
