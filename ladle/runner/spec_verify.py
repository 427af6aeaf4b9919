"""Verification of a step's drafts (speculative decoding), exact for every sampling mode.

A decode row with drafts d_1..d_k computes k + 1 positions in one chunk; each position is sampled exactly as a
plain decode would sample it there (the same parameters, min_tokens by its position, a seeded row's uniform
hashed from its seed and that position: ladle.runner.sampling_batch). The row keeps the samples up to and
including the first that differs from its draft: every sample it keeps was drawn from the target model's
distribution given the tokens before it, which the accepted drafts are. For a draft that is one token
(n-gram lookup proposes tokens, not distributions) this is rejection sampling itself: the draft is accepted
with probability p(d), and on rejection the token is drawn from p with d removed, renormalized. Greedy rows
accept while the draft is the argmax; a seeded row's tokens equal, token for token, those it gets without
drafts; logprobs are the target's at each kept position.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ladle.outputs import Logprob
from ladle.runner.payload import ChunkSpec

Verified = tuple[int, dict[int, Logprob] | None, tuple[tuple[int, dict[int, Logprob] | None], ...]]


def sampled_positions(specs: Sequence[ChunkSpec]) -> np.ndarray:
    """The position each logits row samples, in logits order: a row with k drafts samples its k + 1 last ones."""
    return np.fromiter((s.start_pos + s.num_tokens - len(s.draft_token_ids) + j
                        for s in specs for j in range(len(s.draft_token_ids) + 1)), dtype=np.int64)


def row_owners(specs: Sequence[ChunkSpec]) -> list[int]:
    """The index in specs of each logits row."""
    return [i for i, s in enumerate(specs) for _ in range(len(s.draft_token_ids) + 1)]


def count_drafts(counts: torch.Tensor, penalized_rows: list[int], specs: Sequence[ChunkSpec]) -> None:
    """Penalties at a draft position count the drafts before it as output, as they would be had the plain run
    generated them: counts [penalized rows, vocab] (the output so far, gathered for this step) gains, in the
    row of each penalized sampling row, the drafts its position follows."""
    owner, offset = [], []
    for s in specs:
        for j in range(len(s.draft_token_ids) + 1):
            owner.append(s)
            offset.append(j)
    rows: list[int] = []
    tokens: list[int] = []
    for i, r in enumerate(penalized_rows):
        drafts = owner[r].draft_token_ids[: offset[r]]
        rows += [i] * len(drafts)
        tokens += drafts
    if rows:
        index = (torch.tensor(rows, device=counts.device), torch.tensor(tokens, device=counts.device))
        counts.index_put_(index, torch.ones(len(rows), dtype=counts.dtype, device=counts.device), accumulate=True)


def accept(specs: Sequence[ChunkSpec], token_ids: list[int],
           logprobs: list[dict[int, Logprob] | None]) -> list[Verified]:
    """Per spec, (its token, its logprobs, the accepted drafts before it with their logprobs). A FAILED sample
    matches no draft, so it is the token where the row stops."""
    out: list[Verified] = []
    row = 0
    for s in specs:
        drafts = s.draft_token_ids
        a = 0
        while a < len(drafts) and token_ids[row + a] == drafts[a]:
            a += 1
        out.append((token_ids[row + a], logprobs[row + a],
                    tuple((token_ids[row + j], logprobs[row + j]) for j in range(a))))
        row += len(drafts) + 1
    return out


@torch.inference_mode()
def roll_back_states(states: list[torch.Tensor], specs: Sequence[ChunkSpec], verified: list[Verified],
                     slots: list[int], draft_rows: tuple[int, int]) -> None:
    """A model with state layers: a row that accepted a of its d drafts takes back its state after its first
    1 + a tokens (draft row a: first + slot * k + a, where its layers kept it); one that accepted all keeps what
    its last token left in its slot. states: every state tensor, [rows, ...] each."""
    first, k = draft_rows
    dst, src = [], []
    for s, (_, _, accepted), slot in zip(specs, verified, slots):
        if len(accepted) < len(s.draft_token_ids):
            dst.append(slot)
            src.append(first + slot * k + len(accepted))
    if dst:
        rows_to, rows_from = (torch.tensor(x, device=states[0].device) for x in (dst, src))
        for tensor in states:
            tensor[rows_to] = tensor[rows_from]
