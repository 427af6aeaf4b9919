"""Pydantic models of the OpenAI API subset ladle serves (names as in OpenAI's and vLLM's protocol files).

Requests validate strictly (no "5" -> 5, no true -> 1): a wrong type is the client's bug and gets a 400 that
names the field, rather than a guess. A field ladle does not serve (logit_bias, audio, a newer API's) is a 400
naming it, never silently dropped; messages sent back as they were received may carry output-only keys.
Floats must be finite and strings valid UTF-8 (JSON's escapes can spell a lone surrogate, which no tokenizer
takes): a malformed request never reaches the engine.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from ladle.entrypoints.openai.protocol_base import (  # noqa: F401 -- the protocol's names, importable from here
    EchoModel,
    ErrorInfo,
    ErrorResponse,
    OpenAIBaseModel,
    OpenAIError,
    Text,
    TokenId,
    clip,
    internal_error,
)
from ladle.entrypoints.openai.reasoning_effort import ReasoningEffort
from ladle.entrypoints.openai.structured_request import GuidedFields, ResponseFormat, StructuredOutputsRequest
from ladle.entrypoints.openai.tool_protocol import (
    MAX_TOOLS,
    ChatCompletionToolParam,
    DeltaToolCall,
    ToolCallOut,
    ToolCallParam,
    ToolChoice,
)

# Bounds OpenAI documents; the engine's SamplingParams checks again.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 128  # one request may not fan out into more engine requests than this
MAX_LOGPROBS = 20
# The sampler computes in float32: a positive value below its smallest (2**-149) becomes 0, and one above
# its largest becomes inf. Stated in the schema, so a client's validator knows before it asks.
_F32_TINY, _F32_MAX = 2.0**-149, 3.4028234663852886e38


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(GuidedFields):  # an OpenAIBaseModel
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""
    model: Text | None = None  # None: the served model
    n: int | None = Field(None, ge=1, le=MAX_N)  # default 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    # null means the default, as in OpenAI's API (some clients send explicit nulls).
    temperature: float | None = Field(None, ge=0.0, le=_F32_MAX)  # default 1.0
    top_p: float | None = Field(None, ge=_F32_TINY, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=_F32_TINY, le=_F32_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**63), lt=2**63)  # vLLM's extra: lower first, with --scheduling-policy priority
    user: Text | None = None
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on completions too
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's extra
    # ladle's extra: at most this many speculative drafts a step for this request (0: opt out)
    num_speculative_tokens: int | None = Field(None, ge=0, le=2**31 - 1)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extra: each prompt token's logprob and the top N, in the choices' prompt_logprobs (not with stream)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)


class TextContentPart(EchoModel):
    type: Literal["text"]
    text: Text


class ChatMessage(EchoModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls, sent back in the history
    tool_call_id: Text | None = None  # a tool message: the call it answers
    reasoning_content: Text | None = None  # an assistant's thinking, sent back (templates decide what to keep)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (e.g. enable_thinking)
    # The template's effort control, or its thinking switch (ladle.entrypoints.openai.reasoning_effort).
    reasoning_effort: ReasoningEffort | None = None
    # Hints that change nothing the model sees or generates: field_policy.NO_OPS lists them.
    prompt_cache_key: Text | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    store: bool | None = None  # false only: nothing is stored (true is a 400)

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("this server stores no completions; send store: false (or leave it out)")
        return store


# ---- responses ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served, as OpenAI reports them


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One candidate of a prompt token, as vLLM's prompt_logprobs spell it."""
    logprob: float
    rank: int
    decoded_token: str


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token that ended the choice
    # vLLM's extra, with prompt_logprobs (or echo with logprobs): None for the first prompt token, then token id
    # -> its candidate, the prompt token first.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


def _created() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "ladle"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """GET /health: 200 when the engine process is up and answers a ping ("busy" while one step has run for
    over a second: healthy, but every stream waits for that step); 503 otherwise, the body says why."""
    status: Literal["ok", "busy", "unhealthy", "draining"]
    reason: str | None = None
    engine_state: str
    api_pid: int  # the API process answering (ladle serve's outer process restarts it if it dies)
    api_restarts: int = 0
    engine_pid: int | None = None
    engine_restarts: int = 0
    last_failure: str | None = None
    num_requests_in_flight: int = 0
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    kv_blocks_in_use: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_usage: float | None = None
    step_running_s: float | None = None  # how long the engine's current step has run (0 between steps)
