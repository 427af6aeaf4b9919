"""The engine's contract with the runner, the one runner module the engine imports.

What the engine core sends each step is plain, picklable data (vLLM's SchedulerOutput with NewRequestData and
CachedRequestData): never live Request objects or the KV manager's tables, so a rank in another process (tensor
parallelism) is fed the same bytes; the runner keeps its own copy of each request. What comes back is a
SampledToken per sampled request, or a PendingStep whose tokens are still on the device. The runner appends
the tokens it samples to its copy itself (NewTokens), so the engine sends a request's tokens once, when the
runner first gets it, and afterwards only its new blocks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ladle.kv_cache.disk_tier import DiskStore
from ladle.kv_cache.state_checkpoints import CheckpointCopy
from ladle.outputs import Logprob
from ladle.sampling_params import SamplingParams

FAILED = -1  # the token id of a row that could not be sampled (the engine ends its request)
PROMPT_ONLY = -2  # the token id of a result that only carries a mid-prompt chunk's prompt logprobs


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
    """The blocks a request the runner holds gained since its last payload. Its new tokens are not sent: the
    runner sampled them and appended them itself (NewTokens). (A NamedTuple, as ChunkSpec: built on the hot
    path, and a frozen dataclass costs several times more to build.)"""

    request_id: str
    new_block_ids: tuple[list[int], ...]  # appended to each group's table


class NewTokens(NamedTuple):
    """The tokens a step sampled for one request, which the runner appends to its copy of the request (and a
    tensor-parallel executor ships to the ranks that do not sample): where the first goes, then the tokens."""

    position: int  # the request's length (prompt and output) before them
    token_ids: list[int]


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
    # The prefix cache's host tier (ladle.kv_cache.host_tier): (device block, host slot) copies out, then (host
    # slot, device block) copies in, both before the step's forward.
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier below it (ladle.kv_cache.disk_tier): registered device blocks and checkpoint rows to write out
    # (copied before the forward, and before the host tier's copies), files to delete, and (host slot, pages) read
    # from disk, written into their slots before the saves (blocks into the host tier's, checkpoints into its
    # checkpoints').
    kv_stores: list[DiskStore] = field(default_factory=list)
    kv_unlinks: list[str] = field(default_factory=list)
    kv_fills: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)
    checkpoint_fills: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)
    # The host tier's state checkpoints (ladle.kv_cache.host_tier): (device checkpoint row, host slot)
    # copies out, then (host slot, device checkpoint row) copies in, before any restore.
    checkpoint_saves: list[tuple[int, int]] = field(default_factory=list)
    checkpoint_loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.new_requests or self.diffs or self.removed or self.kv_saves or self.kv_loads
                    or self.kv_stores or self.kv_unlinks or self.kv_fills or self.checkpoint_fills
                    or self.checkpoint_saves or self.checkpoint_loads)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, Logprob] | None
    # Speculative decoding: the row's accepted drafts, with their logprobs, which come before token_id.
    accepted: tuple[tuple[int, dict[int, Logprob] | None], ...] = ()
    drafts: tuple[int, ...] = ()  # the model's own (MTP) drafts of the tokens after token_id
    # SamplingParams.prompt_logprobs: (the first prompt position covered, an entry per position) from this
    # step's chunk. A chunk that samples nothing carries them with token_id PROMPT_ONLY.
    prompt_logprobs: tuple[int, list[dict[int, Logprob]]] | None = None


def new_tokens(specs: list[ChunkSpec], sampled: dict[str, SampledToken]) -> dict[str, NewTokens]:
    """The tokens a step's results add to each request: its accepted drafts, then its sampled token. A FAILED
    token adds nothing (the engine ends its request), nor does a chunk that samples nothing."""
    out = {}
    for s in specs:
        tok = sampled.get(s.request_id)
        if tok is None or tok.token_id == PROMPT_ONLY:
            continue
        at = s.start_pos + s.num_tokens - len(s.draft_token_ids)
        if not tok.accepted:  # (a plain decode row: the hot path of every step)
            if tok.token_id != FAILED:
                out[s.request_id] = NewTokens(at, [tok.token_id])
            continue
        ids = [t for t, _ in tok.accepted]
        if tok.token_id != FAILED:
            ids.append(tok.token_id)
        out[s.request_id] = NewTokens(at, ids)
    return out


class PendingStep:
    """A launched step whose sampled tokens are still on the device.

    Their copy to the host is queued at once, before anything launched later, and result() waits on an event
    recorded right after it: a plain .tolist() would queue the copy behind the step launched ahead and wait
    for that step too, which is exactly the overlap async scheduling is for."""

    def __init__(self, request_ids: list[str], positions: list[int], token_ids: torch.Tensor,
                 on_read: Callable[[dict[str, NewTokens]], None]) -> None:
        """positions: where each request's token goes (its length before it); on_read: given the tokens once
        they are read, so the runner that launched the step appends them to its requests."""
        self.request_ids = request_ids
        self.positions = positions
        self._on_read = on_read
        self._result: dict[str, SampledToken] | None = None
        # [len(request_ids)] on the device, in request order: the next step's input. A FAILED row's request
        # ends when this step is read, so its token in the step ahead is void; 0 keeps the embedding in range.
        self.token_ids = token_ids.clamp_min(0)
        self._event: torch.cuda.Event | None = None
        self._host = token_ids
        if token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> dict[str, SampledToken]:
        """Wait for this step's tokens (not for steps launched after it) and read them; the first call hands
        them to the runner."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        ids = self._host.tolist()
        self._result = {rid: SampledToken(t, None) for rid, t in zip(self.request_ids, ids)}
        self._on_read({rid: NewTokens(p, [t]) for rid, p, t in zip(self.request_ids, self.positions, ids)
                       if t != FAILED})
        return self._result
