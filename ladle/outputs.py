"""Results handed to users, shaped like vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # no __dict__: a big logprobs answer holds hundreds of thousands of these
class Logprob:
    logprob: float
    rank: int  # 1 = most likely under the model's raw distribution
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then token id -> Logprob (the prompt
# token itself plus the top-N), as vLLM's RequestOutput.prompt_logprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    # ladle's own: the sizes of the prefill chunks this sample's prompt ran in, in order (recomputation after
    # a preemption included); set when it finishes.
    prefill_chunks: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (vLLM's field)
    error: str | None = None  # why the engine ended it early (finish_reason "error")
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs, once the prompt ran
