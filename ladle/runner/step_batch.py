"""One step's requests as columns (StepBatch), in step order: the one form the input builders take."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBatch:
    """One step's requests as columns, in step order (the runner fills them in one pass over its requests)."""

    token_ids: list[int] = field(default_factory=list)  # every request's new tokens, concatenated
    start_pos: list[int] = field(default_factory=list)  # tokens of each request already in the KV cache
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each request (>= 1)
    sample: list[bool] = field(default_factory=list)  # whether each request's last new token is sampled from
    # Each request's table per KV cache group; each covers its start_pos + num_tokens tokens, with NULL_BLOCK (-1)
    # where a sliding window gave a block back.
    block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # each request's slot in the state layers (-1: none)
    # Each request's drafts among its new tokens (speculative decoding): its last 1 + drafts positions are
    # sampled, not only its last (None: no request has drafts).
    num_drafts: list[int] | None = None
    # With drafts on a model with state layers: the state rows where each request's state after each of its
    # first num_drafts new tokens goes (a rejected draft rolls back to one of them).
    draft_rows: list[tuple[int, ...]] | None = None

    def add(self, token_ids: list[int], start_pos: int, block_ids: tuple[list[int], ...] | list[int], sample: bool,
            state_slot: int = -1) -> StepBatch:
        """One more request, for a step built by hand (profiling, tests, benchmarks; the runner fills the columns
        in one pass): its new tokens, where they start, its table per group (a plain list: the one group),
        whether its last new token samples, and its state slot. Returns the batch, so additions chain."""
        self.token_ids.extend(token_ids)
        self.start_pos.append(start_pos)
        self.num_tokens.append(len(token_ids))
        self.sample.append(sample)
        self.block_ids.append(block_ids if isinstance(block_ids, tuple) else (list(block_ids),))
        self.state_slots.append(state_slot)
        return self

    def __len__(self) -> int:
        return len(self.start_pos)

    @property
    def is_decode_only(self) -> bool:
        """Every request one sampled token."""
        return len(self.token_ids) == len(self.start_pos) and all(self.sample)
