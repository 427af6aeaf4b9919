"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same engine, limits,
validation, parsers and prefix reuse as chat. A request is read into a chat request (system and content blocks
to messages, tool_use and tool_result to tool calls and tool messages, thinking to the template's switch), and
the answer written as Anthropic's content blocks: thinking, text, tool_use, streamed with its event sequence."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

from fastapi import Request

from ladle.entrypoints.openai.anthropic_protocol import (
    AnthropicMessage, CountTokensRequest, ImageBlock, MessagesRequest, RedactedThinkingBlock, TextBlock,
    ThinkingBlock, ToolResultBlock, ToolUseBlock, anthropic_error,
)
from ladle.entrypoints.openai.chat_output import ChoiceReader, read_whole
from ladle.entrypoints.openai.messages_stream import BlockWriter, event, stop_reason
from ladle.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, clip
from ladle.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat, chat_request
from ladle.entrypoints.openai.serving_engine import respond


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat, self.ctx = chat, chat.ctx

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        prepared = await self.chat.prepare(to_chat(req, None, False), "msg", count_only=True)
        return {"input_tokens": prepared.prompt_tokens}

    async def create_message(self, req: MessagesRequest, raw_request: Request) -> Any:
        prepared = await self.chat.prepare(to_chat(req, req.max_tokens, req.stream), "msg")
        return await respond(prepared.stream, self._events(prepared), lambda: self._message(prepared),  # type: ignore[arg-type]
                             req.stream, raw_request)

    def _message(self, p: PreparedChat) -> Iterator[bytes]:
        stream = p.stream
        assert stream is not None
        c = stream.choices[0]
        piece, calls = read_whole(self.ctx.chat, p.plan, p.thinking, c.detok.output_text,
                                  self.ctx.count_tool_calls)
        content: list[dict[str, Any]] = []
        if piece.reasoning:
            content.append({"type": "thinking", "thinking": piece.reasoning, "signature": "ladle"})
        if piece.content and not (calls and not piece.content.strip()):
            content.append({"type": "text", "text": piece.content})
        for t in calls:
            content.append({"type": "tool_use", "id": tool_use_id(t.id), "name": t.name, "input": _object(t.arguments)})
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(calls))
        usage = stream.usage
        body = {"id": stream.request_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}}
        yield json.dumps(body, ensure_ascii=False).encode()

    async def _events(self, p: PreparedChat) -> AsyncIterator[str]:
        stream = p.stream
        assert stream is not None
        yield event("message_start", {"message": {
            "id": stream.request_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": p.prompt_tokens, "output_tokens": 0}}})
        yield event("ping", {})
        reader = ChoiceReader(self.ctx.chat, p.plan, p.thinking, self.ctx.count_tool_calls)
        blocks = BlockWriter(tool_use_id)
        try:
            async for deltas in stream.deltas():
                for d in deltas:
                    for out in blocks.take(reader.feed(d.text)):
                        yield out
                    if d.finish_reason is not None:
                        for out in blocks.take(reader.finish()):
                            yield out
            for out in blocks.close():
                yield out
            c = stream.choices[0]
            reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(reader.calls))
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": {"input_tokens": p.prompt_tokens,
                                                    "output_tokens": stream.usage.completion_tokens}})
            yield event("message_stop", {})
        except OpenAIError as e:
            yield event("error", anthropic_error(e.status, e.message))
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here


def to_chat(req: CountTokensRequest, max_tokens: int | None, stream: bool) -> ChatCompletionRequest:
    """The chat request an Anthropic request is; 400 (OpenAIError) naming what cannot be served."""
    messages: list[dict[str, Any]] = []
    if req.system:
        text = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": text})
    called: set[str] = set()  # the tool_use ids of the last assistant turn
    for i, m in enumerate(req.messages):
        if m.role == "assistant":
            # Consecutive assistant messages are one turn, as Anthropic reads them.
            ids = {b.id for b in m.content if isinstance(b, ToolUseBlock)} if isinstance(m.content, list) else set()
            called = called | ids if i and req.messages[i - 1].role == "assistant" else ids
        else:
            _check_results(i, m, called)
        messages += _messages(i, m)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.name), ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
            for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        if tc.type == "tool" and not tc.name:
            raise OpenAIError(400, "tool_choice of type tool needs a name", param="tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            tc.type, {"type": "function", "function": {"name": tc.name}})
        body["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    if req.thinking is not None:
        on = req.thinking.type != "disabled"
        body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}  # Qwen's and DeepSeek's switch
    if isinstance(req, MessagesRequest):
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    return chat_request(body)


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
            thoughts.append(b.thinking)
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
