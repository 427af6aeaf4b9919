"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same engine, limits,
validation, parsers and prefix reuse as chat. A request is read into a chat request (system and content blocks
to messages, system messages where they stand, tool_use and tool_result to tool calls and tool messages, thinking
to the template's switch, output_config's effort to its reasoning_effort and its format to response_format),
after its context_management edits; the answer is written as Anthropic's content blocks: thinking, text,
tool_use, streamed with its event sequence, and its usage splits the prompt into what the prefix cache served
(cache_read_input_tokens) and the rest (input_tokens). count_tokens counts the prompt /v1/messages renders."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from ladle.entrypoints.openai.anthropic.context_edits import (
    Messages,
    clear_thinking,
    clear_tool_uses,
    keeps_all_thinking,
    triggered,
)
from ladle.entrypoints.openai.anthropic.protocol import (
    AnthropicMessage,
    ClearThinkingEdit,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    SystemMessage,
    TextBlock,
    ThinkingBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_error,
)
from ladle.entrypoints.openai.anthropic.stream import BlockWriter, event, stop_reason, usage
from ladle.entrypoints.openai.anthropic.thinking_signature import SHOWN, seal, unseal
from ladle.entrypoints.openai.chat.output import ChoiceReader, read_whole
from ladle.entrypoints.openai.chat.render import chars, chat_prompt, render
from ladle.entrypoints.openai.chat.serving import OpenAIServingChat, PreparedChat, chat_request
from ladle.entrypoints.openai.field_policy import (
    BETA,
    BILLING_HEADER,
    BILLING_PREFIX,
    KEEP_ALL_THINKING,
    MESSAGES_EFFORT,
    header_no_ops,
)
from ladle.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, clip
from ladle.entrypoints.openai.serving_engine import client_of, respond
from ladle.entrypoints.openai.session_routing import session_hint


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat, self.ctx = chat, chat.ctx

    async def count_tokens(self, req: CountTokensRequest, raw_request: Request) -> dict[str, int]:
        header_no_ops("messages", BETA, raw_request.headers.get(BETA))
        chat, _ = await self._chat(req, None, False)
        prepared = await self.chat.prepare(chat, "msg", count_only=True)
        return {"input_tokens": prepared.prompt_tokens}

    async def create_message(self, req: MessagesRequest, raw_request: Request) -> Any:
        no_ops = header_no_ops("messages", BETA, raw_request.headers.get(BETA))
        chat, taken = await self._chat(req, req.max_tokens, req.stream)
        effort = req.output_config.effort if req.output_config is not None else None
        if effort is not None and "reasoning_effort" not in self.chat.effort_controls:
            taken.append(MESSAGES_EFFORT)  # the template has no control for it (reasoning_effort.py)
        self.ctx.metrics.no_ops("messages", no_ops + taken)
        user = req.metadata.user_id if req.metadata is not None else None
        prepared = await self.chat.prepare(chat, "msg", client=client_of(raw_request),
                                           session=session_hint(raw_request.headers, user_id=user))
        omit = req.thinking is not None and req.thinking.display == "omitted"
        return await respond(prepared.stream, self._events(prepared, omit), lambda: self._message(prepared, omit),  # type: ignore[arg-type]
                             req.stream, raw_request)

    async def _chat(self, req: CountTokensRequest, max_tokens: int | None,
                    stream: bool) -> tuple[ChatCompletionRequest, list[str]]:
        """The chat request req is, after its context_management edits in order, and the value no-ops it took
        (field_policy). An edit that counts tokens counts the prompt as it stands before it."""
        messages: Messages = list(req.messages)
        taken: list[str] = []
        for edit in req.context_management.edits if req.context_management else []:
            if isinstance(edit, ClearThinkingEdit):
                if keeps_all_thinking(edit):
                    taken.append(KEEP_ALL_THINKING)
                messages = clear_thinking(messages, edit)
                continue
            before = await self._count(req, messages) if edit.trigger.type == "input_tokens" else None
            if not triggered(edit, messages, before):
                continue
            cleared = clear_tool_uses(messages, edit)
            if edit.clear_at_least is not None and cleared is not messages:
                before = before if before is not None else await self._count(req, messages)
                if before - await self._count(req, cleared) < edit.clear_at_least.value:
                    continue  # as Anthropic does: a clearing that saves too little is not worth a cache miss
            messages = cleared
        chat, more = to_chat(req, messages, max_tokens, stream)
        return chat, taken + more

    async def _count(self, req: CountTokensRequest, messages: Messages) -> int:
        prompt = chat_prompt(to_chat(req, messages, None, False)[0], self.ctx.chat.chat_template)
        ids, _, _ = await self.ctx.pool.run(lambda tok: render(tok, prompt, False), chars(prompt))
        return len(ids)

    def _message(self, p: PreparedChat, omit_thinking: bool) -> Iterator[bytes]:
        stream = p.stream
        assert stream is not None
        c = stream.choices[0]
        piece, calls = read_whole(self.ctx.chat, p.plan, p.thinking, c.detok.output_text,
                                  self.ctx.count_tool_calls)
        content: list[dict[str, Any]] = []
        if piece.reasoning:
            content.append({"type": "thinking", "thinking": "", "signature": seal(piece.reasoning)} if omit_thinking
                           else {"type": "thinking", "thinking": piece.reasoning, "signature": SHOWN})
        if piece.content and not (calls and not piece.content.strip()):
            content.append({"type": "text", "text": piece.content})
        for t in calls:
            content.append({"type": "tool_use", "id": tool_use_id(t.id), "name": t.name, "input": _object(t.arguments)})
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(calls))
        body = {"id": stream.request_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(stream.usage)}
        yield json.dumps(body, ensure_ascii=False).encode()

    async def _events(self, p: PreparedChat, omit_thinking: bool) -> AsyncIterator[str]:
        stream = p.stream
        assert stream is not None
        reader = ChoiceReader(self.ctx.chat, p.plan, p.thinking, self.ctx.count_tool_calls)
        blocks = BlockWriter(tool_use_id, omit_thinking)
        started = False
        try:
            async for deltas in stream.deltas():
                if not started:
                    # The engine's first output says how much of the prompt the prefix cache served, which
                    # message_start's usage reports; nothing else could go out before it anyway.
                    yield self._start(p)
                    started = True
                for d in deltas:
                    for out in blocks.take(reader.feed(d.text)):
                        yield out
                    if d.finish_reason is not None:
                        for out in blocks.take(reader.finish()):
                            yield out
            if not started:
                yield self._start(p)
            for out in blocks.close():
                yield out
            c = stream.choices[0]
            reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(reader.calls))
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": usage(stream.usage)})
            yield event("message_stop", {})
        except OpenAIError as e:
            yield event("error", anthropic_error(e.status, e.message))
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here

    def _start(self, p: PreparedChat) -> str:
        assert p.stream is not None
        return event("message_start", {"message": {
            "id": p.stream.request_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**usage(p.stream.usage), "output_tokens": 0}}}) + event("ping", {})


def to_chat(req: CountTokensRequest, anthropic_messages: Messages, max_tokens: int | None,
            stream: bool) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request an Anthropic request is, with anthropic_messages (its messages, edited) for its own, and
    the value no-ops it took (field_policy); 400 (OpenAIError) naming what cannot be served."""
    messages: list[dict[str, Any]] = []
    taken: list[str] = []
    if req.system:
        blocks = [TextBlock(type="text", text=req.system)] if isinstance(req.system, str) else req.system
        # Billing metadata that changes between sessions (and, in some versions, every request): rendered, it
        # would put a different token at the prompt's start each time and no prefix would ever be shared.
        if any(b.text.startswith(BILLING_PREFIX) for b in blocks):
            taken.append(BILLING_HEADER)
        text = "".join(b.text for b in blocks if not b.text.startswith(BILLING_PREFIX))
        if text:
            messages.append({"role": "system", "content": text})
    called: set[str] = set()  # the tool_use ids of the last assistant turn
    loaded: set[str] = set()  # the deferred tools tool_reference blocks loaded
    for i, m in enumerate(anthropic_messages):
        if isinstance(m, SystemMessage):
            later_user = any(n.role == "user" for n in anthropic_messages[i + 1:])
            if not (m.clear_at == "next_user_message" and later_user):
                messages.append({"role": "system", "content": m.text()})
            continue
        if m.role == "assistant":
            # Consecutive assistant messages are one turn, as Anthropic reads them.
            ids = {b.id for b in m.content if isinstance(b, ToolUseBlock)} if isinstance(m.content, list) else set()
            called = called | ids if i and anthropic_messages[i - 1].role == "assistant" else ids
        else:
            _check_results(i, m, called)
            loaded |= _references(m)
        messages += _messages(i, m)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    # A deferred tool is out of the prompt until a tool_reference loads it, as with Anthropic's tool search.
    tools = [t for t in req.tools or [] if not t.defer_loading or t.name in loaded]
    if tools:
        body["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.name), ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
            for t in tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        if tc.type == "tool" and not tc.name:
            raise OpenAIError(400, "tool_choice of type tool needs a name", param="tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            tc.type, {"type": "function", "function": {"name": tc.name}})
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        on = req.thinking.type != "disabled"
        kwargs.update(enable_thinking=on, thinking=on)  # Qwen's and DeepSeek's switch
    out = req.output_config
    if out is not None and out.effort is not None:
        kwargs["reasoning_effort"] = out.effort  # as Anthropic spells it: low, medium, high, xhigh, max
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if out is not None and out.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": out.format.schema_}}
    if isinstance(req, MessagesRequest):
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return chat_request(body), taken


def _messages(i: int, m: AnthropicMessage) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, thoughts, results = [], [], [], []
    for j, b in enumerate(m.content):
        if isinstance(b, ImageBlock):
            raise OpenAIError(400, f"messages[{i}].content[{j}]: {b.type} blocks are not supported (text only)",
                              param="messages")
        if isinstance(b, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)) and m.role == "user":
            raise OpenAIError(400, f"messages[{i}].content[{j}]: a {b.type} block belongs to an assistant turn",
                              param="messages")
        if isinstance(b, ToolResultBlock) and m.role == "assistant":
            raise OpenAIError(400, f"messages[{i}].content[{j}]: a tool_result block belongs to a user turn",
                              param="messages")
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
                b.input, ensure_ascii=False)}})
        elif isinstance(b, ThinkingBlock):
            try:
                thoughts.append(unseal(b.thinking, b.signature))
            except ValueError as e:
                raise OpenAIError(400, f"messages[{i}].content[{j}]: {e}", param="messages") from None
        elif isinstance(b, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": ("Error: " if b.is_error else "") + b.text()})
        # A redacted thinking block is sealed: nothing in it can be read back, so the turn goes on without it.
    if m.role == "user":
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return [msg]


def _references(m: AnthropicMessage) -> set[str]:
    """The tools a user message's tool_reference blocks load."""
    results = [b for b in m.content if isinstance(b, ToolResultBlock)] if isinstance(m.content, list) else []
    return {r.tool_name for b in results if isinstance(b.content, list) for r in b.content
            if isinstance(r, ToolReferenceBlock)}


def _check_results(i: int, m: AnthropicMessage, called: set[str]) -> None:
    """Each tool_result answers a tool_use of the previous assistant turn, as Anthropic requires: one that does
    not (a typo, a history cut short, a result sent ahead of its call) is a 400 naming it."""
    for j, b in enumerate(m.content if isinstance(m.content, list) else []):
        if isinstance(b, ToolResultBlock) and b.tool_use_id not in called:
            raise OpenAIError(400, f"messages[{i}].content[{j}]: tool_result's tool_use_id "
                              f"{clip(b.tool_use_id)!r} matches no tool_use block in the previous assistant "
                              "message; each tool_result answers a tool_use of the turn before it",
                              code="invalid_value", param=f"messages[{i}].content[{j}].tool_use_id")


def _object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
