"""A request inside the engine core: its tokens, how many have KV, its status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ladle.outputs import Logprob
from ladle.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


def child_request_ids(parent_id: str, num_children: int) -> list[str]:
    """The engine requests' ids for one user request of num_children (prompts x n) children, offline and served
    alike: the parent's own id for a lone child, else parent-i for the i-th (prompt-major)."""
    return [parent_id] if num_children == 1 else [f"{parent_id}-{i}" for i in range(num_children)]


class RequestRejected(ValueError):
    """A request that can never be served; raised when it is added, never after it waited."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) + params.stop_token_ids
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, served by the prefix cache at the last admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None
    num_preemptions: int = 0
    num_passed_over: int = 0  # admissions that jumped ahead while the KV pool could not take this one
    # The prefix cache's keys of the full blocks seen so far (kv_cache.manager), made once per block.
    block_tokens: list = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # their SHA-256 chain (ladle.kv_cache.disk_format)
    prefill_chunks: list[int] = field(default_factory=list)  # the sizes of the prefill chunks run, in order
    # Token positions where the frontend saw a message end: state checkpoints go there (rounded to a block).
    checkpoint_marks: tuple[int, ...] = ()
    # The client's session (a prompt_cache_key, metadata.user_id or session header, digested): when the request
    # ends, its prefix is kept ahead of plain LRU victims for the session's next turn (kv_cache.session_retention).
    session_id: str | None = None
    # The model's own drafts (speculative_config method mtp) of the tokens after its last one, from the step
    # that sampled it.
    spec_token_ids: tuple[int, ...] = ()
    # With sampling_params.prompt_logprobs: the entry of each prompt position as its chunks return them
    # (None until then, and always at 0), handed out with the first output token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's rule: a request that wants prompt logprobs computes its whole prompt (a cached token has
        no logits), until the first output token has carried them out; a recomputation after a preemption may
        then read the cache like any other."""
        return self.prompt_logprobs is not None and not self.output_token_ids

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while more than one known token lacks KV: a (re)prefill, never sampled mid-way."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0

    def append_output(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
