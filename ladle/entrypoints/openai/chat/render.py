"""A chat request rendered to its prompt: messages as the templates want them (an assistant's tool-call
arguments as objects, as vLLM hands them over), the tools, the template's own keywords, and the same tokens the
offline LLM.chat would make. Runs on a tokenizer thread."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from ladle.entrypoints.openai.chat.system_placement import fold_system, has_later_system, renders_system_in_place
from ladle.entrypoints.openai.protocol_base import OpenAIError, clip
from ladle.entrypoints.openai.reasoning_effort import effort_kwargs
from ladle.frontend.message_marks import message_ends

# Keywords the server itself passes to the template: a request's chat_template_kwargs may not set them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "return_dict",
                       "documents", "continue_final_message"})


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]  # the template's own (enable_thinking, reasoning_effort, ...)
    template: str | None  # the server's --chat-template, else the tokenizer's
    add_generation_prompt: bool


def chat_prompt(req: Any, template: str | None, controls: frozenset[str] = frozenset()) -> ChatPrompt:
    """Checks what the template cannot (tool-call arguments that are not objects, a tool message that answers
    no earlier call, reserved keywords); controls: the effort controls the template reads (reasoning_effort)."""
    messages = []
    called: set[str] = set()  # the ids of the calls assistant messages made so far
    for i, m in enumerate(req.messages):
        # As OpenAI requires: a result with no call before it (a typo, a history cut short, a result sent ahead
        # of its call) is the client's bug, not an answer the model should read. A call without a result passes.
        if m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in called:
            raise OpenAIError(400, f"messages[{i}].tool_call_id {clip(m.tool_call_id)!r} matches no tool call of an "
                              "earlier assistant message; a tool message answers a call in an assistant message's "
                              "tool_calls before it", code="invalid_value", param=f"messages[{i}].tool_call_id")
        if m.role == "assistant":
            called.update(tc.id for tc in m.tool_calls or [])
        d = m.model_dump(exclude_none=True)
        d.setdefault("content", "")
        if m.tool_calls:
            calls = []
            for j, tc in enumerate(m.tool_calls):
                try:
                    args = tc.arguments_object()
                except ValueError as e:
                    raise OpenAIError(400, f"messages[{i}].tool_calls[{j}].function.arguments {e} (JSON text of "
                                      "an object)", code="invalid_value", param="messages") from None
                calls.append({"id": tc.id, "type": "function", "function": {"name": tc.function.name,
                                                                           "arguments": args}})
            d["tool_calls"] = calls
        messages.append(d)
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(_RESERVED & kwargs.keys())
    if bad:
        raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(bad)}: the request's own fields do",
                          code="invalid_value", param="chat_template_kwargs")
    kwargs = {**effort_kwargs(req.reasoning_effort, controls)[0], **kwargs}  # the template's own keywords win
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ChatPrompt(messages, tools, kwargs, template, req.add_generation_prompt)


def chars(prompt: ChatPrompt) -> int:
    """The text a render encodes, about (for the tokenizer pool's heap trimming)."""
    return sum(len(m["content"]) if isinstance(m["content"], str) else sum(len(p["text"]) for p in m["content"])
               for m in prompt.messages) + len(str(prompt.tools or ""))


def render(tokenizer: Any, p: ChatPrompt, mark: bool) -> tuple[list[int], tuple[int, ...], str]:
    """The prompt's token ids, where its last messages end (with mark; ladle.frontend.message_marks), and its
    text. Encoded without adding special tokens again, as LLM.chat does, so one conversation gives one prompt."""
    def text_of(messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = p.tools) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=p.template,
                                             add_generation_prompt=generation_prompt, **p.kwargs)

    messages = p.messages
    # Probed without the tools, which cost most of a render and move no message in any template we know.
    if has_later_system(messages) and not renders_system_in_place(lambda probe: text_of(probe, False, None)):
        messages = fold_system(messages)
    try:
        text = text_of(messages, p.add_generation_prompt)
    except TemplateSyntaxError as e:
        # The template itself does not parse: no request can fix that, so it is the server's error.
        raise OpenAIError(500, f"the model's chat template is broken ({e}); no request can be rendered with it",
                          code="chat_template_error") from None
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise OpenAIError(400, f"the chat template could not render these messages: {e}",
                          code="invalid_value", param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise OpenAIError(400, "the messages render to an empty prompt", code="invalid_value", param="messages")
    if not mark:
        return ids, (), text
    return ids, message_ends(messages, ids, lambda head: tokenizer.encode(
        text_of(list(head), False), add_special_tokens=False)), text
