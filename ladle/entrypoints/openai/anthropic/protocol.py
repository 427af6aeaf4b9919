"""The Anthropic Messages API's request models (as the official anthropic client sends them) and its error
envelope. Content blocks tolerate extra keys (clients echo whole response blocks back, with citations: null and
the like); everything else is strict, and a field ladle does not serve is a 400 naming it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.entrypoints.openai.protocol_base import OpenAIBaseModel, Text

ANTHROPIC = "/v1/messages"  # the routes that answer in Anthropic's shapes

# status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Request(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    cache_control: dict[str, Any] | None = None  # a no-op (field_policy), declared so that it is counted


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ImageBlock(_Block):
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]


class ToolReferenceBlock(_Block):
    """A tool search's answer: loads the deferred tool it names (defer_loading) into the prompt's tools."""
    type: Literal["tool_reference"]
    tool_name: Text


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock | ImageBlock | ToolReferenceBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content if isinstance(b, TextBlock))
        return self.content or ""


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class AnthropicMessage(_Block):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class SystemMessage(_Request):
    """A system message among the messages (Claude Code's per-turn reminders): rendered where it stands
    (ladle.entrypoints.openai.chat.system_placement), never hoisted to the front."""
    role: Literal["system"]
    content: Text | list[TextBlock]
    # "next_user_message": shown only until a later user message exists; "never" (the default): always.
    clear_at: Literal["next_user_message", "never"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


AnyMessage = Annotated[AnthropicMessage | SystemMessage, Field(discriminator="role")]


class AnthropicTool(_Request):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # a no-op (field_policy)
    # Accepted either way: a forced call (tool_choice any or tool) always follows the whole schema.
    strict: bool | None = None
    # Left out of the prompt's tool list until a tool_reference block loads it (ladle.entrypoints.openai
    # .serving_messages), as Anthropic's tool search does.
    defer_loading: bool | None = None


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    # A target, as Anthropic documents it (the model may stop short of it): not enforced here.
    budget_tokens: int | None = Field(None, ge=1)
    # "omitted": thinking blocks go out empty, their reasoning sealed in the signature (thinking_signature.py);
    # "summarized" (Anthropic's default) gets the whole reasoning: ladle writes no summaries, and the reasoning is
    # what a summary would shorten.
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Request):
    user_id: Text | None = None


class ThinkingTurns(_Request):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class AllThinkingTurns(_Request):
    type: Literal["all"]


class ClearThinkingEdit(_Request):
    """Drops the thinking blocks of all but the last keep assistant turns (Anthropic's default: 1)."""
    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | AllThinkingTurns | Literal["all"] = ThinkingTurns(type="thinking_turns", value=1)


class InputTokens(_Request):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(_Request):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ClearToolUsesEdit(_Request):
    """Past its trigger, replaces the results (and, with clear_tool_inputs, the inputs) of all but the last keep
    tool uses with a placeholder; exclude_tools are never cleared; with clear_at_least, only a clearing that
    saves that many input tokens is made. Defaults as Anthropic documents them."""
    type: Literal["clear_tool_uses_20250919"]
    trigger: InputTokens | ToolUses = InputTokens(type="input_tokens", value=100_000)
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    clear_tool_inputs: bool | list[Text] | None = None
    exclude_tools: list[Text] | None = None


ContextEdit = Annotated[ClearThinkingEdit | ClearToolUsesEdit, Field(discriminator="type")]


class ContextManagement(_Request):
    edits: list[ContextEdit] = Field(default_factory=list)


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    # Passed to the chat template as reasoning_effort, as chat completions' reasoning_effort is.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None  # enforced as response_format's json_schema is


class CountTokensRequest(_Request):
    model: Text
    messages: list[AnyMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # a no-op (field_policy)
    cache_control: dict[str, Any] | None = None  # a no-op (field_policy): the request-wide caching hint


# ---- responses (documented in the OpenAPI document; the handlers write the JSON themselves) ----
class AnthropicUsage(BaseModel):
    input_tokens: int  # the prompt tokens the prefix cache did not serve
    output_tokens: int
    cache_read_input_tokens: int  # the prompt tokens the prefix cache served
    cache_creation_input_tokens: int = 0  # ladle's cache is written as it computes, at no extra count


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int
