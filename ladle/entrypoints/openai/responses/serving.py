"""POST /v1/responses: the OpenAI Responses API, stateless, on the same engine, parsers and limits as chat. A
request is read into a chat request (instructions to the system message, items to messages: a function_call or
custom_tool_call to an assistant's tool call, its output item to the tool's answer, reasoning to
reasoning_content; tools as ladle.entrypoints.openai.responses.tools shows them), and the answer written as
output items, whole or streamed (ladle.entrypoints.openai.responses.stream), calls under the client's names."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from ladle.entrypoints.openai.chat.output import ChoiceReader, read_whole
from ladle.entrypoints.openai.chat.reasoning_parser import thinking_tokens
from ladle.entrypoints.openai.chat.serving import OpenAIServingChat, PreparedChat, chat_request
from ladle.entrypoints.openai.field_policy import RESPONSES_EFFORT, hosted_tool
from ladle.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, clip
from ladle.entrypoints.openai.reasoning_effort import effort_kwargs
from ladle.entrypoints.openai.responses.protocol import (
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    MessageItem,
    Part,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from ladle.entrypoints.openai.responses.stream import ResponsesWriter, message_item, reasoning_item, tool_item
from ladle.entrypoints.openai.responses.tools import (
    ResponsesTools,
    custom_arguments,
    custom_input,
    model_name,
    responses_tools,
)
from ladle.entrypoints.openai.serving_engine import client_of, respond, sse_error
from ladle.entrypoints.openai.session_routing import session_hint


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat, self.ctx = chat, chat.ctx

    async def create_response(self, req: ResponsesRequest, raw_request: Request) -> Any:
        if req.previous_response_id is not None:
            raise OpenAIError(400, "previous_response_id: this server stores no responses (it is stateless); send "
                              "the whole conversation as input", code="previous_response_not_found",
                              param="previous_response_id")
        if req.store:
            raise OpenAIError(400, "store: this server stores no responses; send store: false (or leave it out)",
                              code="unsupported_parameter", param="store")
        tools = responses_tools(req.tools)
        prepared = await self.chat.prepare(to_chat(req, tools), "resp", client=client_of(raw_request),
                                           grammars=tools.grammars,
                                           session=session_hint(raw_request.headers, req.prompt_cache_key))
        ignored = [hosted_tool(kind) for kind in sorted(set(tools.hosted))]  # offered, not shown
        if req.reasoning and effort_kwargs(req.reasoning.effort, self.chat.effort_controls)[1]:
            ignored.append(RESPONSES_EFFORT)
        self.ctx.metrics.no_ops("responses", ignored)
        created = int(time.time())
        return await respond(prepared.stream, self._events(req, prepared, created, tools),  # type: ignore[arg-type]
                             lambda: self._whole(req, prepared, created, tools), req.stream, raw_request)

    def _response(self, req: ResponsesRequest, p: PreparedChat, created: int, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        assert p.stream is not None
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        choice = req.tool_choice
        return {
            "id": p.stream.request_id, "object": "response", "created_at": created, "status": status,
            "model": self.ctx.model_name, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {}, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else
            (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []],
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": None, "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                                                        "summary": None},
            "text": {"format": fmt or {"type": "text"}, "verbosity": req.text.verbosity if req.text else None},
            "truncation": "disabled", "store": False, "usage": usage,
        }

    def _usage(self, p: PreparedChat) -> dict[str, Any]:
        """Tokens as the engine counted them: cached_tokens the prefix cache served, reasoning_tokens the
        generated tokens of the thinking (never more than output_tokens)."""
        assert p.stream is not None
        u = p.stream.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        parser = self.ctx.chat.reasoning
        thought = thinking_tokens(parser, p.thinking, p.stream.choices[0].token_ids, p.stream.texts) if parser else 0
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached,
                                                                          "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def _whole(self, req: ResponsesRequest, p: PreparedChat, created: int, tools: ResponsesTools) -> Iterator[bytes]:
        assert p.stream is not None
        c = p.stream.choices[0]
        piece, calls = read_whole(self.ctx.chat, p.plan, p.thinking, c.detok.output_text,
                                  self.ctx.count_tool_calls)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        output = [reasoning_item(piece.reasoning)] if piece.reasoning else []
        if piece.content and not (calls and not piece.content.strip()):
            output.append(message_item(piece.content))
        for t in calls:
            tool = tools.client(t.name)
            output.append(tool_item(tool, t.id, custom_input(t.arguments) if tool.custom else t.arguments))
        if output and status == "incomplete":
            output[-1]["status"] = "incomplete"
        body = self._response(req, p, created, status, output, self._usage(p))
        yield json.dumps(body, ensure_ascii=False).encode()

    async def _events(self, req: ResponsesRequest, p: PreparedChat, created: int,
                      tools: ResponsesTools) -> AsyncIterator[str]:
        stream = p.stream
        assert stream is not None
        writer = ResponsesWriter(lambda status, output, usage: self._response(req, p, created, status, output, usage),
                                 tools.client)
        reader = ChoiceReader(self.ctx.chat, p.plan, p.thinking, self.ctx.count_tool_calls)
        for out in writer.start():
            yield out
        try:
            async for deltas in stream.deltas():
                for d in deltas:
                    pieces = [reader.feed(d.text)] + ([reader.finish()] if d.finish_reason is not None else [])
                    for piece in pieces:
                        for out in writer.take(piece):
                            yield out
            status = "incomplete" if stream.choices[0].finish_reason == "length" else "completed"
            for out in writer.finish(status, self._usage(p)):
                yield out
        except OpenAIError as e:
            yield sse_error(e)
        finally:
            stream.abort()  # no-op when it finished; a client that hung up frees its KV blocks here


def to_chat(req: ResponsesRequest, tools: ResponsesTools) -> ChatCompletionRequest:
    """The chat request a Responses request is, its tools as tools shows them; 400 naming what cannot be
    served."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    thought: list[str] = []
    called: set[str] = set()  # the call_ids of the function_call items so far
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            raise OpenAIError(400, f"input[{i}]: item_reference needs stored items; this server stores none",
                              param="input")
        if isinstance(item, ReasoningItem):
            thought += [t.text for t in (item.content or item.summary)]
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            msg: dict[str, Any] = {"role": role, "content": _text(item.content, i)}
            if role == "assistant" and thought:
                msg["reasoning_content"], thought = "".join(thought), []
            messages.append(msg)
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            called.add(item.call_id)
            arguments = item.arguments if isinstance(item, FunctionCallItem) else custom_arguments(item.input)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": model_name(item.name, item.namespace), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last.get("_answered"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought:
                messages[-1]["reasoning_content"], thought = "".join(thought), []
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            if item.call_id not in called:  # as OpenAI answers it: an output needs its call earlier in input
                raise OpenAIError(400, f"input[{i}]: no tool call found for {item.type} with call_id "
                                  f"{clip(item.call_id)!r} (a {item.type} answers a call earlier in input)",
                                  code="invalid_value", param=f"input[{i}].call_id")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["_answered"] = True
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, i)})
    for m in messages:
        m.pop("_answered", None)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "stream": req.stream}
    if tools.functions:
        body["tools"] = tools.functions
    choice = tools.chat_choice(req.tool_choice)
    if choice is not None:
        body["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in (("name", fmt.name or "response"),
                                                                     ("schema", fmt.schema_), ("strict", fmt.strict))
                                                   if v is not None}})
    return chat_request(body)


def _text(content: str | list[Part], i: int) -> str:
    if isinstance(content, str):
        return content
    bad = next((p.type for p in content if not isinstance(p, TextPart)), None)
    if bad is not None:
        raise OpenAIError(400, f"input[{i}]: {bad} parts are not supported (text only)", param="input")
    return "".join(p.text for p in content if isinstance(p, TextPart))
