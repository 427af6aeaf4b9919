"""Prompt-lookup drafts (vLLM's `ngram` method): the tokens that followed an earlier occurrence of the request's
last n tokens. The longest n in [prompt_lookup_min, prompt_lookup_max] that occurs earlier wins, and of its
occurrences the earliest, as vLLM picks. Costs nothing on the model: a coding agent's edits and quotes copy
long spans of their context, which is where it pays.

Each request's tokens are kept as a growing numpy array, so a step appends the new tokens instead of
converting a 30K-token list again."""
from __future__ import annotations

import numpy as np


class _Tokens:
    __slots__ = ("buf", "n")

    def __init__(self, tokens: list[int]) -> None:
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.buf[: len(tokens)] = tokens
        self.n = len(tokens)

    def sync(self, tokens: list[int]) -> np.ndarray:
        """The array of tokens (a list that only grew since the last call)."""
        if len(tokens) > len(self.buf):
            grown = np.empty(2 * len(tokens), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if len(tokens) > self.n:
            self.buf[self.n : len(tokens)] = tokens[self.n :]
        self.n = len(tokens)
        return self.buf[: self.n]


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of n tokens, n in
    [min_n, max_n]; () when none occurs."""
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return ()
    last = tokens[-1]
    # Candidate ends of an occurrence: a position holding the last token, before the last one itself.
    ends = np.flatnonzero(tokens[: total - 1] == last)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(cand):
                break
            cand = cand[tokens[cand - back] == tokens[total - 1 - back]]
        if len(cand):
            start = int(cand[0]) + 1
            return tuple(tokens[start : start + k].tolist())
    return ()


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> tuple[int, ...]:
        """Drafts for the request whose tokens (prompt and output so far) these are."""
        held = self._tokens.get(request_id)
        if held is None or held.n > len(tokens):  # new, or recomputed with fewer tokens than seen
            held = self._tokens[request_id] = _Tokens(tokens)
        return propose(held.sync(tokens), self.min_n, self.max_n, k)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
