"""The chat request and response pieces of tool calling and reasoning, as OpenAI and vLLM spell them."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ladle.entrypoints.openai.protocol_base import EchoModel, OpenAIBaseModel, Text

MAX_TOOLS = 256  # functions one request may offer


class _Strict(OpenAIBaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted either way: a forced call always follows the whole schema


class ChatCompletionToolParam(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallParam(EchoModel):
    name: Text
    arguments: Text  # JSON text of an object, as OpenAI sends it


class ToolCallParam(EchoModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as the chat templates want them (a dict); ValueError when they are not an object."""
        text = self.function.arguments.strip() or "{}"
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("is not a JSON object")
        return value


# ---- responses ----
class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
