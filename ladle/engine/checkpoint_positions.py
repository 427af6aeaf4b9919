"""Where a request's state is checkpointed while it prefills, so later requests can resume there: every
state_checkpoint_interval tokens, where its prompt ends (and one block earlier when the prompt is block-aligned:
a request with the very same prompt stops its hit before the last token), and where the frontend marked a
message's end (Request.checkpoint_marks). Each rounded down to a block boundary: a hit resumes only there."""
from __future__ import annotations

from dataclasses import replace

from ladle.engine.scheduler_output import ScheduledRequest
from ladle.kv_cache.manager import KVCacheManager
from ladle.request import Request


def next_checkpoint(req: Request, start: int, interval: int, block_size: int) -> int | None:
    """The first checkpoint position after start that req's known tokens reach, or None."""
    candidates = [(start // interval + 1) * interval]
    for pos in (req.num_prompt_tokens, req.num_prompt_tokens - 1, *req.checkpoint_marks):
        at = pos // block_size * block_size
        if at > start:
            candidates.append(at)
    best = min(candidates)
    return best if best <= req.num_tokens else None


def checkpoint_at(kv: KVCacheManager, interval: int, req: Request, start: int) -> int | None:
    """req's next checkpoint position after start, where the engine keeps checkpoints (None elsewhere)."""
    return next_checkpoint(req, start, interval, kv.block_size) if kv.checkpointing else None


def with_checkpoint(kv: KVCacheManager, interval: int, s: ScheduledRequest) -> ScheduledRequest:
    """The chunk s saving its request's state where it ends, if that is a checkpoint position (and a
    checkpoint slot is free)."""
    end = s.start_pos + s.num_new_tokens
    if checkpoint_at(kv, interval, s.request, s.start_pos) != end:
        return s
    copy = kv.plan_checkpoint(s.request.request_id, end)
    return s if copy is None else replace(s, checkpoint=copy)
