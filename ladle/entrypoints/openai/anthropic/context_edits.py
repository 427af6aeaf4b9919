"""Anthropic's context_management edits: what they clear from a conversation before it is rendered. The client
keeps the whole history and sends it every turn; the edits decide what of it the model sees, as Anthropic's
servers do. Pure functions over the request's messages; the caller counts tokens where an edit asks for them."""
from __future__ import annotations

from dataclasses import dataclass

from ladle.entrypoints.openai.anthropic.protocol import (
    AnthropicMessage,
    ClearThinkingEdit,
    ClearToolUsesEdit,
    RedactedThinkingBlock,
    SystemMessage,
    TextBlock,
    ThinkingBlock,
    ThinkingTurns,
    ToolResultBlock,
    ToolUseBlock,
)

Messages = list[AnthropicMessage | SystemMessage]

# What the model reads where a tool result (or a call's input) was: that something was there and is gone.
CLEARED_RESULT = "[tool result cleared to save context]"


def keeps_all_thinking(edit: ClearThinkingEdit) -> bool:
    """keep "all" clears nothing: every thinking block goes to the template, as without the edit."""
    return edit.keep == "all" or edit.keep.type == "all"


def clear_thinking(messages: Messages, edit: ClearThinkingEdit) -> Messages:
    """The thinking blocks of all but the last keep assistant turns dropped (a run of assistant messages is one
    turn, as Anthropic reads them)."""
    if keeps_all_thinking(edit):
        return messages
    keep = edit.keep
    assert isinstance(keep, ThinkingTurns)  # not "all" in either spelling
    turn, turns = -1, []  # each message's turn number; -1 before the first assistant turn
    for i, m in enumerate(messages):
        if m.role == "assistant" and not (i and messages[i - 1].role == "assistant"):
            turn += 1
        turns.append(turn)
    first_kept = turn + 1 - keep.value
    out: Messages = []
    for m, t in zip(messages, turns):
        if m.role == "assistant" and t < first_kept and isinstance(m.content, list):
            m = m.model_copy(update={"content": [b for b in m.content
                                                 if not isinstance(b, (ThinkingBlock, RedactedThinkingBlock))]})
        out.append(m)
    return out


@dataclass(frozen=True)
class ToolUse:
    message: int  # the assistant message that made the call
    name: str
    id: str


def tool_uses(messages: Messages) -> list[ToolUse]:
    """The calls the conversation made, oldest first."""
    return [ToolUse(i, b.name, b.id) for i, m in enumerate(messages) if m.role == "assistant"
            and isinstance(m.content, list) for b in m.content if isinstance(b, ToolUseBlock)]


def triggered(edit: ClearToolUsesEdit, messages: Messages, input_tokens: int | None) -> bool:
    """Whether the conversation is past the edit's trigger (input_tokens: the prompt without this edit; None when
    the trigger does not count tokens)."""
    if edit.trigger.type == "tool_uses":
        return len(tool_uses(messages)) > edit.trigger.value
    assert input_tokens is not None
    return input_tokens > edit.trigger.value


def clear_tool_uses(messages: Messages, edit: ClearToolUsesEdit) -> Messages:
    """The results of all but the last keep calls replaced by CLEARED_RESULT, oldest first, except the calls of
    exclude_tools; with clear_tool_inputs (true, or a list of tool names) those calls' inputs emptied too."""
    uses = tool_uses(messages)
    excluded = set(edit.exclude_tools or ())
    cleared = {u.id: u.name for u in uses[:max(0, len(uses) - edit.keep.value)] if u.name not in excluded}
    if not cleared:
        return messages
    inputs = edit.clear_tool_inputs

    def clear_input(name: str) -> bool:
        return inputs is True or (isinstance(inputs, list) and name in inputs)

    out: Messages = []
    for m in messages:
        if isinstance(m, AnthropicMessage) and isinstance(m.content, list):
            blocks = []
            for b in m.content:
                if isinstance(b, ToolResultBlock) and b.tool_use_id in cleared:
                    b = b.model_copy(update={"content": [TextBlock(type="text", text=CLEARED_RESULT)]})
                elif isinstance(b, ToolUseBlock) and b.id in cleared and clear_input(b.name):
                    b = b.model_copy(update={"input": {}})
                blocks.append(b)
            m = m.model_copy(update={"content": blocks})
        out.append(m)
    return out
