"""What the engine core hands its frontends for each request after a step: plain data (no torch), so the
server's API process can receive it without importing the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from ladle.outputs import Logprob


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None
    error: str | None = None
    num_cached_tokens: int | None = None  # on a request's first token: prompt tokens the prefix cache served
