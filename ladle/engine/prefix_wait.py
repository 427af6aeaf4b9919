"""Deferring a waiting request whose prefix another request is about to write."""
from __future__ import annotations

from ladle.request import Request


def prefix_in_flight(req: Request, num_cached: int, end: int, others: list[Request]) -> bool:
    """True when one of the running or starting requests has yet to write req's prefix up to end, the next
    position req could resume from (its next block, or its next checkpoint position on a model with state
    checkpoints), having the same tokens before it.

    Waiting for it (one step, or until that request's chunked prefill passes the position) beats computing
    the same KV twice. This is how n > 1 siblings, admitted together, share their prompt: the first
    prefills it, the others follow a step later and hit its blocks. Requests behind a deferred one may be
    admitted meanwhile; the deferred one keeps its place at the head of the queue.
    """
    if req.skip_reading_prefix_cache:
        return False  # it reads no prefix (prompt logprobs): nothing to wait for
    if end > req.num_tokens - 1:
        return False  # no further block of req would be reused: a hit stops before the last token
    tokens = req.all_token_ids
    for other in others:
        ids = other.all_token_ids
        if (other.num_computed_tokens < end <= len(ids) and ids[num_cached:end] == tokens[num_cached:end]
                and ids[:num_cached] == tokens[:num_cached]):
            return True
    return False
