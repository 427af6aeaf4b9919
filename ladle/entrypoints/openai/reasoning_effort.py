"""OpenAI's grades of thinking (chat's reasoning_effort, the Responses API's reasoning.effort) as the chat
template's own controls. A template that reads `reasoning_effort` gets the grade as sent (gpt-oss's does); one
with only a thinking switch (Qwen3's and DeepSeek's `enable_thinking`) thinks for every grade but "none", which
turns thinking off; a template with neither cannot be told. Where the grade itself has no control (the switch
only, or nothing), it is taken without effect and counted on /metrics (field_policy)."""
from __future__ import annotations

import re
from typing import Any, Literal

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

_VARIABLES = ("reasoning_effort", "enable_thinking")


def template_controls(tokenizer: Any, template: str | None) -> frozenset[str]:
    """Which of the effort controls the chat template reads (the server's --chat-template, else each of the
    tokenizer's templates). A template that names a variable reads it: its text is searched, since transformers'
    templates use Jinja extensions a plain parse would refuse."""
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    texts = list(source.values()) if isinstance(source, dict) else [source] if isinstance(source, str) else []
    return frozenset(v for v in _VARIABLES if any(re.search(rf"\b{v}\b", t) for t in texts))


def effort_kwargs(effort: ReasoningEffort | None, controls: frozenset[str]) -> tuple[dict[str, Any], bool]:
    """The template keywords a grade becomes, and whether the grade was taken without effect (the template has
    no control for it)."""
    if effort is None:
        return {}, False
    if "reasoning_effort" in controls:
        return {"reasoning_effort": effort}, False
    if "enable_thinking" in controls:
        return {"enable_thinking": effort != "none"}, effort != "none"
    return {}, True
