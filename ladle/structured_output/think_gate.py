"""Where a reasoning model's thinking block leaves a constrained request (ThinkTags): unconstrained while it
thinks, its grammar enforced from the token after the block's end tag.

The prompt says where generation starts: after an open start tag (a template that opens the block for the
model), the request is thinking; otherwise its first token may open a block (a single-token start tag joins the
grammar's allowed tokens for that token alone), and from any other first token on the grammar holds. While
thinking, every token but EOS may come, so a request never ends inside its thinking block claiming to be done.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ladle.sampling_params import ThinkTags


class Gate(enum.Enum):
    THINKING = "thinking"  # inside the block: no grammar, tokens not fed to the matcher
    MAY_OPEN = "may_open"  # the next token may open a block, or begin the grammar's text
    ENFORCED = "enforced"  # the grammar holds


def last_index(seq: list[int], sub: tuple[int, ...]) -> int:
    """Where sub last starts in seq, or -1."""
    end = len(seq)
    while True:
        try:
            i = end - 1 - seq[end - 1::-1].index(sub[0]) if end else -1
        except ValueError:
            return -1
        if i < 0 or tuple(seq[i:i + len(sub)]) == sub:
            return i
        end = i


@dataclass
class ThinkGate:
    tags: ThinkTags
    state: Gate
    tail: list[int] = field(default_factory=list)  # the last tokens while thinking, matched against the end tag
    fed: int = 0  # tokens fed to the matcher so far

    @classmethod
    def at_prompt(cls, tags: ThinkTags, prompt: list[int]) -> ThinkGate:
        if tags.initial is not None:  # the frontend read the rendered prompt
            state = Gate(tags.initial)
            return cls(tags, Gate.ENFORCED if state is Gate.MAY_OPEN and len(tags.start) != 1 else state)
        if last_index(prompt, tags.start) > last_index(prompt, tags.end):
            return cls(tags, Gate.THINKING)
        return cls(tags, Gate.MAY_OPEN if len(tags.start) == 1 else Gate.ENFORCED)

    def take(self, token_id: int) -> bool:
        """Advance by a committed token; True when it belongs to the grammar's text (the matcher takes it)."""
        if self.state is Gate.THINKING:
            self.tail = (self.tail + [token_id])[-len(self.tags.end):]
            if tuple(self.tail) == self.tags.end:
                self.state, self.tail = Gate.ENFORCED, []
            return False
        if self.state is Gate.MAY_OPEN:
            if token_id == self.tags.start[0]:
                self.state = Gate.THINKING
                return False
            self.state = Gate.ENFORCED
        self.fed += 1
        return True
