"""The Responses API's answer: output items (reasoning, message, function_call, custom_tool_call) built from a
choice's pieces, whole or as the API's event sequence: response.created, then per item output_item.added, its
content part and deltas (a call's arguments, a custom tool's input as it is decoded), their done events and
output_item.done, then response.completed (or response.incomplete at max_output_tokens) carrying the whole
output. Every event is numbered (sequence_number) and the response id never changes, as
client.responses.stream() checks. Calls carry the client's names (responses_tools.ClientTool)."""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from ladle.entrypoints.openai.chat.output import ChoicePiece
from ladle.entrypoints.openai.responses.tools import ClientTool, InputStream, custom_input


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": rid or item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": mid or item_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def tool_item(tool: ClientTool, call_id: str, payload: str, status: str = "completed") -> dict[str, Any]:
    """A call: a function_call with its arguments, or a custom_tool_call with its input (payload); the namespace
    beside the name for a namespace's tool."""
    where = {"namespace": tool.namespace} if tool.namespace else {}
    if tool.custom:
        return {"type": "custom_tool_call", "id": item_id("ctc"), "call_id": call_id, "name": tool.name,
                "input": payload, **where, "status": status}
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id, "name": tool.name,
            "arguments": payload, **where, "status": status}


class ResponsesWriter:
    """The event sequence of one streamed response. response(status, output, usage) makes the Response object
    each lifecycle event carries."""

    def __init__(self, response: Callable[[str, list[dict[str, Any]], dict[str, Any] | None], dict[str, Any]],
                 client: Callable[[str], ClientTool]) -> None:
        """client: a call's tool as the client knows it, by the name the model wrote."""
        self.response, self.client = response, client
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.open: dict[str, Any] | None = None  # the item being written, with its text so far
        self.arguments = ""  # the open call's arguments as the model wrote them (a custom tool's, undecoded)
        self.input: InputStream | None = None  # the open custom tool call's input, decoded as it comes

    def event(self, kind: str, data: dict[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        for kind in ("response.created", "response.in_progress"):
            yield self.event(kind, {"response": self.response("in_progress", [], None)})

    def take(self, piece: ChoicePiece) -> Iterator[str]:
        if piece.reasoning:
            yield from self._text("reasoning", piece.reasoning)
        calling = self.open is not None and self.open["type"] in ("function_call", "custom_tool_call")
        if piece.content and not (calling and not piece.content.strip()):
            yield from self._text("message", piece.content)
        for t in piece.tool_calls:
            if t.name is not None:
                yield from self._close()
                tool = self.client(t.name)
                self.open = tool_item(tool, t.id or item_id("call"), "", "in_progress")
                self.arguments, self.input = "", InputStream() if tool.custom else None
                yield self.event("response.output_item.added", {"output_index": len(self.output),
                                                                "item": dict(self.open)})
            if t.arguments and self.open is not None:
                yield from self._arguments(t.arguments)

    def finish(self, status: str, usage: dict[str, Any]) -> Iterator[str]:
        yield from self._close("incomplete" if status == "incomplete" else "completed")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, {"response": self.response(status, self.output, usage)})

    def _text(self, kind: str, text: str) -> Iterator[str]:
        if self.open is None or self.open["type"] != kind:
            yield from self._close()
            self.open = (reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress"))
            part = dict(self.open["content"][0])
            added = dict(self.open, content=[])
            yield self.event("response.output_item.added", {"output_index": len(self.output), "item": added})
            yield self.event("response.content_part.added", {**self._where(), "part": part})
        self.open["content"][0]["text"] += text
        delta_kind = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, list[object]] = {} if kind == "reasoning" else {"logprobs": []}
        yield self.event(delta_kind, {**self._where(), "delta": text, **extra})

    def _arguments(self, delta: str) -> Iterator[str]:
        assert self.open is not None
        self.arguments += delta
        where = {"item_id": self.open["id"], "output_index": len(self.output)}
        if self.input is None:
            self.open["arguments"] = self.arguments
            yield self.event("response.function_call_arguments.delta", {**where, "delta": delta})
            return
        text = self.input.feed(self.arguments)
        if text:
            self.open["input"] += text
            yield self.event("response.custom_tool_call_input.delta", {**where, "delta": text})

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def _close(self, status: str = "completed") -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        index = len(self.output)
        if item["type"] == "function_call":
            yield self.event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "arguments": item["arguments"], "name": item["name"]})
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_input(self.arguments)  # whole: the streamed pieces, or the text as written
            yield self.event("response.custom_tool_call_input.done", {
                "item_id": item["id"], "output_index": index, "input": item["input"]})
        else:
            part, where = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, list[object]] = {} if item["type"] == "reasoning" else {"logprobs": []}
            yield self.event(done, {**where, "text": part["text"], **extra})
            yield self.event("response.content_part.done", {**where, "part": part})
        yield self.event("response.output_item.done", {"output_index": index, "item": item})
        self.output.append(item)
