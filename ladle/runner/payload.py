"""What the engine core sends the model runner each step: plain, picklable data (vLLM's SchedulerOutput with
NewRequestData and CachedRequestData). Never live Request objects or the KV manager's tables, so a worker in
another process (tensor parallelism) can be fed the same way; the runner keeps its own copy of each request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ladle.kv_cache.state_checkpoints import CheckpointCopy
from ladle.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner does not hold: new, or coming back after a preemption or a restart."""

    request_id: str
    token_ids: list[int]  # the prompt, then any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the params' stop token ids
    block_ids: tuple[list[int], ...]  # its block table, per KV cache group
    state_slot: int = -1  # its slot in the state layers (models with StateSpec layers), new at each admission
    restore: CheckpointCopy | None = None  # the state checkpoint its prefix hit resumes from


class RequestDiff(NamedTuple):
    """What a request the runner holds gained since its last payload. (A NamedTuple, as ChunkSpec: one of
    each per request per step, and a frozen dataclass costs several times more to build.)"""

    request_id: str
    new_token_ids: list[int]
    new_block_ids: tuple[list[int], ...]  # appended to each group's table; () when none grew


class ChunkSpec(NamedTuple):
    """One request's share of a step."""

    request_id: str
    start_pos: int  # tokens already in the KV cache
    num_tokens: int
    sample: bool  # the chunk reaches the request's last known token, so a token is sampled
    checkpoint: CheckpointCopy | None = None  # where the runner saves the request's state after the chunk
    # A constrained request's allowed tokens for the token this chunk samples: int32 words, bit t % 32 of word
    # t // 32 set when token t may come next (None: unconstrained).
    bitmask: np.ndarray | None = None
    # A decode row's drafts: its new tokens are its last known token and these; every one of its positions is
    # sampled, and the drafts that match the samples are accepted (ladle.runner.spec_verify).
    draft_token_ids: tuple[int, ...] = ()
    # mtp: the drafts the model's MTP layer makes after the token this chunk samples, for the next step; -1 (on
    # every chunk of the step): the layer rests, its cache not written.
    num_proposals: int = 0


@dataclass
class StateUpdate:
    """Applied once per step, before the step (or its retries) runs."""

    new_requests: list[NewRequest] = field(default_factory=list)
    diffs: list[RequestDiff] = field(default_factory=list)
    # Finished, aborted, preempted or restarted: the runner forgets them (one that runs again comes back whole).
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.new_requests or self.diffs or self.removed)
