"""One step's requests, as the runner hands them to the input builders: ScheduledChunk per request, StepBatch
as columns."""
from __future__ import annotations

from dataclasses import dataclass


class ScheduledChunk:
    """One request's share of a step: its new tokens, where they start, and its blocks. (A slotted class, not
    a frozen dataclass: callers build one per request per step, and a frozen dataclass costs several times
    more to build.)"""

    __slots__ = ("token_ids", "start_pos", "block_ids", "sample", "state_slot")

    def __init__(self, token_ids: list[int], start_pos: int, block_ids: tuple[list[int], ...] | list[int],
                 sample: bool, state_slot: int = -1) -> None:
        self.token_ids = token_ids  # tokens whose KV this step computes (a prefill chunk, or one decode token)
        self.start_pos = start_pos  # tokens of this request already in the KV cache (num_computed_tokens)
        # The request's block table per KV cache group (a plain list: the one group); each covers
        # start_pos + len(token_ids) tokens, with NULL_BLOCK (-1) where a sliding window gave a block back.
        self.block_ids: tuple[list[int], ...] = block_ids if isinstance(block_ids, tuple) else (list(block_ids),)
        self.sample = sample  # True when this chunk reaches the end of the known tokens, so a token is sampled
        self.state_slot = state_slot  # the request's slot in the state layers (models with StateSpec layers)


@dataclass
class StepBatch:
    """One step's requests as columns, in step order (the runner fills them in one pass over its requests)."""

    token_ids: list[int]  # every request's new tokens, concatenated
    start_pos: list[int]  # tokens of each request already in the KV cache
    num_tokens: list[int]  # new tokens of each request (>= 1)
    sample: list[bool]  # whether each request's last new token is sampled from
    block_ids: list[tuple[list[int], ...]]  # each request's table per KV cache group
    state_slots: list[int]  # each request's slot in the state layers (-1: none)
    # Each request's drafts among its new tokens (speculative decoding): its last 1 + drafts positions are
    # sampled, not only its last (None: no request has drafts).
    num_drafts: list[int] | None = None
    # With drafts on a model with state layers: the state rows where each request's state after each of its
    # first num_drafts new tokens goes (a rejected draft rolls back to one of them).
    draft_rows: list[tuple[int, ...]] | None = None

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> "StepBatch":
        return cls([t for c in chunks for t in c.token_ids], [c.start_pos for c in chunks],
                   [len(c.token_ids) for c in chunks], [c.sample for c in chunks], [c.block_ids for c in chunks],
                   [c.state_slot for c in chunks])

    def __len__(self) -> int:
        return len(self.start_pos)

    @property
    def is_decode_only(self) -> bool:
        """Every request one sampled token."""
        return len(self.token_ids) == len(self.start_pos) and all(self.sample)
