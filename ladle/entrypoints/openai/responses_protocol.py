"""The OpenAI Responses API's request, stateless (what Codex-style agents send): input as text or items, tools
flat as the API spells them, text.format for structured output. Items tolerate extra keys, since clients send
a response's output items straight back; the request itself is strict, so what ladle does not serve (stored
responses, other tool types, images) is a 400 naming it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ladle.entrypoints.openai.protocol_base import OpenAIBaseModel, Text
from ladle.entrypoints.openai.tool_protocol import FunctionDefinition


class _Request(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class UnsupportedPart(_Item):
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Part = Annotated[TextPart | UnsupportedPart, Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Part]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[Part]


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


class ItemReference(_Item):
    type: Literal["item_reference"]


def _kind(item: Any) -> str:
    """An item's type; an easy input message ({"role", "content"}) has none and is a message."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[ItemReference, Tag("item_reference")],
                      Discriminator(_kind)]


class FunctionTool(FunctionDefinition):
    """The API's tools are flat: the chat function's fields beside the type."""
    type: Literal["function"]


class NamedFunction(_Request):
    type: Literal["function"]
    name: Text


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class Reasoning(_Request):
    effort: Literal["minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool | None = None  # false only: nothing is stored, so true is a 400
    previous_response_id: Text | None = None  # stateless: a 400 naming it
    metadata: dict[str, Text] | None = None  # echoed back, as the API does
    user: Text | None = None


class ResponseObject(BaseModel):
    """The response (documented in the OpenAPI document; the handler writes the JSON itself)."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
