"""The OpenAI Responses API's request, stateless (what Codex-style agents send): input as text or items, tools
flat as the API spells them (functions, custom tools with free-form input, namespaces holding either, and the
hosted tools OpenAI runs), text.format for structured output. Items tolerate extra keys, since clients send a
response's output items straight back; the request itself is strict, so what ladle does not serve (stored
responses, images, a tool type it does not know) is a 400 naming it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from ladle.entrypoints.openai.protocol_base import OpenAIBaseModel, Text, clip
from ladle.entrypoints.openai.reasoning_effort import ReasoningEffort
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
    namespace: Text | None = None  # a function of a namespace tool: its name is the function's own


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[Part]


class CustomToolCallItem(_Item):
    type: Literal["custom_tool_call"]
    call_id: Text
    name: Text
    input: Text  # the raw text the model wrote for the tool
    namespace: Text | None = None


class CustomToolCallOutputItem(_Item):
    type: Literal["custom_tool_call_output"]
    call_id: Text
    output: Text | list[Part]


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    # Codex asks for it (include) and sends back what it got: null from this server, which encrypts nothing.
    encrypted_content: Text | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _unreadable(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server issues no encrypted reasoning and cannot read another server's; send "
                             "the reasoning as summary or content text, or leave the item out")
        return value


class ItemReference(_Item):
    type: Literal["item_reference"]


def _kind(item: Any) -> str:
    """An item's type; an easy input message ({"role", "content"}) has none and is a message."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
                      | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[ItemReference, Tag("item_reference")],
                      Discriminator(_kind)]


class FunctionTool(FunctionDefinition):
    """The API's tools are flat: the chat function's fields beside the type."""
    type: Literal["function"]


class TextInputFormat(_Request):
    type: Literal["text"]


class GrammarInputFormat(_Request):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Text = Field(min_length=1)


class CustomTool(_Request):
    """A tool whose input is free text, not JSON arguments (Codex's apply_patch), held to a Lark grammar or a
    regex when format says so (how the model is shown it: ladle.entrypoints.openai.responses.tools)."""
    type: Literal["custom"]
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = None
    format: Annotated[TextInputFormat | GrammarInputFormat, Field(discriminator="type")] | None = None


class NamespaceTool(_Request):
    """Tools grouped under a name (Codex's sub-agent tools, MCP servers); each is called by its own name with
    the namespace beside it."""
    type: Literal["namespace"]
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]] = Field(min_length=1)


# Tools OpenAI runs on its side (or, local_shell, with call items of their own): ladle has none of them.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "image_generation", "local_shell", "mcp")


class HostedTool(_Item):
    """A hosted tool, whatever its settings (they configure a tool that is not run here)."""
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


_TOOL_TYPES = ("function", "custom", "namespace", *HOSTED_TOOLS)


def _tool_type(tool: Any) -> object:  # a dict's type is whatever JSON the client sent
    return tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", "")


def _known_tool(tool: Any) -> Any:
    """A tool of a type this server does not know is named as such, not as its first missing field."""
    kind = _tool_type(tool)
    if isinstance(tool, dict) and kind not in _TOOL_TYPES:
        if not isinstance(kind, str):
            raise ValueError(f"a tool needs a type ({', '.join(_TOOL_TYPES)})")
        raise ValueError(f"tool type {clip(kind)!r} is not one this server knows ({', '.join(_TOOL_TYPES)})")
    return tool


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
                 | Annotated[NamespaceTool, Tag("namespace")]
                 | Annotated[HostedTool, Tag("hosted")], Discriminator(
                     lambda t: _tool_type(t) if _tool_type(t) in ("function", "custom", "namespace") else "hosted"),
                 BeforeValidator(_known_tool)]


class NamedFunction(_Request):
    type: Literal["function"]
    name: Text
    namespace: Text | None = None


class NamedCustom(_Request):
    type: Literal["custom"]
    name: Text
    namespace: Text | None = None


class HostedChoice(_Item):
    """tool_choice naming a hosted tool: a 400 naming it, since none runs here."""
    type: Literal[HOSTED_TOOLS]  # type: ignore[valid-type]


def _known_choice(choice: Any) -> Any:
    kind = _tool_type(choice) if isinstance(choice, dict) else None
    if isinstance(choice, dict) and kind not in ("function", "custom", *HOSTED_TOOLS):
        shown = repr(clip(kind)) if isinstance(kind, str) else "none"
        raise ValueError(f"tool_choice of type {shown} is not one this server knows (function, custom, or a hosted "
                         "tool's type)")
    return choice


ToolChoice = Annotated[Literal["none", "auto", "required"] | Annotated[
    Annotated[NamedFunction, Tag("function")] | Annotated[NamedCustom, Tag("custom")]
    | Annotated[HostedChoice, Tag("hosted")],
    Discriminator(lambda c: _tool_type(c) if _tool_type(c) in ("function", "custom") else "hosted")],
    BeforeValidator(_known_choice)]


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a no-op (field_policy)


class Reasoning(_Request):
    effort: ReasoningEffort | None = None  # the template's control (ladle.entrypoints.openai.reasoning_effort)
    summary: Literal["auto", "concise", "detailed"] | None = None  # a no-op (field_policy)


class ResponsesRequest(_Request):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
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
    # Hints that change nothing the model sees or generates: field_policy.NO_OPS lists them.
    user: Text | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    prompt_cache_key: Text | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's session and turn ids
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


class ResponseObject(BaseModel):
    """The response (documented in the OpenAPI document; the handler writes the JSON itself)."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
