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

from typing import Sequence

import numpy as np

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
