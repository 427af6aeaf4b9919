"""System messages after the first, where the chat template can put them.

Agents add system messages as a conversation goes (Claude Code sends one after its first user message). They stay
where they stand: hoisted to the front, they would change the prompt's start every turn, and every earlier turn
would be computed again instead of coming from the prefix cache. A template that renders a system message in the
middle (Qwen3's, Llama 3's) gets it there; one that drops it or refuses it (Qwen3.5's, DeepSeek-V4's) gets it
folded into the message before it, which never changes once sent, so the prompt up to it stays the same as the
conversation grows. Which one a template does is found by rendering a probe, with the request's template keywords.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A text no conversation holds: the probe asks where the template put it.
_PROBE = "ladle-system-probe"
_FOLD = "\n\n"  # between a message's text and the system text folded into it

Render = Callable[[list[dict[str, Any]]], str]  # messages -> the template's text, no generation prompt


def renders_system_in_place(render: Render) -> bool:
    """Whether the template renders a system message between a user and an assistant message, in that order."""
    probe = [{"role": "user", "content": _PROBE + "-user"}, {"role": "system", "content": _PROBE + "-system"},
             {"role": "assistant", "content": _PROBE + "-assistant"}]
    try:
        text = render(probe)
    except Exception:  # noqa: BLE001 -- a template that refuses the probe (raise_exception) cannot place it
        return False
    at = [text.find(_PROBE + part) for part in ("-user", "-system", "-assistant")]
    return -1 not in at and at == sorted(at)


def has_later_system(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "system" for m in messages[1:])


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each system message after the first joins the user or system message right before it; after any other
    message (an assistant's turn, a tool result) it becomes a user message of its own."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "system" or i == 0:
            out.append(m)
            continue
        text = _text(m.get("content"))
        prev = out[-1]
        if prev.get("role") in ("user", "system"):
            out[-1] = {**prev, "content": _joined(prev.get("content"), text)}
        else:
            out.append({"role": "user", "content": text})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content)
    return content or ""


def _joined(content: Any, text: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": _FOLD + text}]
    return (content or "") + _FOLD + text
