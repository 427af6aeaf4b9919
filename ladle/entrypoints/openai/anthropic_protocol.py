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


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock | ImageBlock] | None = None
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


class AnthropicTool(_Request):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # a no-op (field_policy)


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    # A target, as Anthropic documents it (the model may stop short of it): not enforced here.
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Request):
    user_id: Text | None = None


class CountTokensRequest(_Request):
    model: Text
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # a no-op (field_policy)


# ---- responses (documented in the OpenAPI document; the handlers write the JSON themselves) ----
class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


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
