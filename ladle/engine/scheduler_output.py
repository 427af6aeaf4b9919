"""What the scheduler decides for one step: which requests run, how many new tokens each, who was preempted."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ladle.kv_cache.state_checkpoints import CheckpointCopy
from ladle.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start_pos: int  # num_computed_tokens when scheduled
    num_new_tokens: int
    is_prefill: bool  # a (re)prefill chunk rather than one decode token
    checkpoint: CheckpointCopy | None = None  # the state checkpoint this chunk saves where it ends
    bitmask: np.ndarray | None = None  # a constrained request's allowed next tokens (StructuredOutputManager)
    # A decode row's drafts (speculative decoding): its new tokens are its last token and these, each verified.
    draft_token_ids: tuple[int, ...] = ()
    num_proposals: int = 0  # mtp: the drafts the model's MTP layer makes after this row's sampled token

    @property
    def samples(self) -> bool:
        """A token is sampled only when this chunk reaches the end of the request's known tokens."""
        return self.start_pos + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    prefix_cache_queries: int = 0  # tokens of the requests admitted this step, looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    prefix_cache_hit_requests: int = 0  # admitted requests with a hit
    mtp_rests: bool = False  # the model's MTP layer neither drafts nor writes its cache this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_prefill)

    @property
    def num_prefill_chunks(self) -> int:
        return len(self.scheduled) - self.num_decodes

    def shrink(self, max_tokens: int) -> SchedulerOutput:
        """The same step cut to max_tokens tokens, in schedule order (decodes first). A request cut short
        or dropped simply has fewer tokens computed this step; its blocks and slots stay as they were."""
        kept, left = [], max_tokens
        for s in self.scheduled:
            n = min(s.num_new_tokens, left)
            if n > 0:  # a chunk cut short does not reach its checkpoint position; a row cut short, its last drafts
                kept.append(replace(s, num_new_tokens=n, checkpoint=s.checkpoint if n == s.num_new_tokens else None,
                                    draft_token_ids=s.draft_token_ids[: n - 1] if s.draft_token_ids else ()))
                left -= n
        return replace(self, scheduled=kept)
