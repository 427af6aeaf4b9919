"""Where a chat prompt's messages end, in tokens: the frontend applies the chat template, so it knows, and the
engine checkpoints a state model's state there (Request.checkpoint_marks). The next turn of an agent resends
the conversation with a new tail (a tool result, a re-rendered reply with its thinking dropped); a checkpoint
at the end of the last unchanged message lets it resume there."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

LAST_MESSAGES = 3  # the latest message ends: earlier ones were marked on earlier turns


def message_ends(messages: Sequence[dict[str, Any]], ids: list[int],
                 render: Callable[[Sequence[dict[str, Any]]], list[int]]) -> tuple[int, ...]:
    """Token positions in ids where each of the last messages (but the final one) ends, where rendering the
    conversation up to that message (render: messages -> token ids, no generation prompt) gives a prefix of
    ids. A template that renders a partial conversation differently, or not at all, marks nothing there."""
    marks = []
    for end in range(max(1, len(messages) - LAST_MESSAGES), len(messages)):
        try:
            head = render(messages[:end])
        except Exception:  # noqa: BLE001 -- a template may refuse a partial conversation: no mark, no error
            continue
        if 0 < len(head) < len(ids) and ids[: len(head)] == head:
            marks.append(len(head))
    return tuple(marks)
