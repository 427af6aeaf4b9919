"""PLE's hashed n-gram ids (HF's Qwen4ExpTextNGramEmbedding, without its table): for each position, the
n-grams ending there (orders 2..ngram_size) of the previous ngram_size - 1 tokens, each hashed into
heads_per_ngram tables of distinct prime sizes.

The previous tokens are read "EOS-aware": a shift that would cross an end-of-sequence token, or reach before
the sequence, reads the EOS id instead. The ids at a position depend only on the ngram_size - 1 tokens before
it, so a prefill chunk needs exactly those (the request's n-gram context, kept in its state slot; EOS ids for
a first chunk) to give what HF gives over the whole sequence.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multiplier of each shift (0..ngram_size-1) for the ple_index-th PLE layer."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


@functools.lru_cache(maxsize=8)
def primes_after(start: int, count: int) -> tuple[int, ...]:
    """The first count primes greater than start."""
    primes: list[int] = []
    p = start
    while len(primes) < count:
        p += 1
        if _is_prime(p):
            primes.append(p)
    return tuple(primes)


class NGramHash:
    """One PLE layer's hashing: token windows -> row ids of its (concatenated) n-gram tables."""

    def __init__(self, config: Any, ple_index: int) -> None:
        self.ngram_size = config.ngram_size
        self.context_len = config.ngram_size - 1
        self.heads_per_ngram = config.heads_per_ngram
        heads = self.context_len * self.heads_per_ngram
        eos = config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        primes = primes_after(config.ngram_vocab_size_base - 1, len(config.ple_layer_ids) * heads)
        self.sizes = list(primes[ple_index * heads:(ple_index + 1) * heads])
        self.offsets = [sum(self.sizes[:i]) for i in range(heads)]
        self.total_rows = sum(self.sizes)
        divisor = config.make_ngram_vocab_size_divisible_by
        self.padded_rows = -(-self.total_rows // divisor) * divisor
        self.multipliers = layer_multipliers(config.vocab_size, self.ngram_size, ple_index, config.seed)

    def rows(self, windows: torch.Tensor) -> torch.Tensor:
        """Windows [T, ngram_size] -> table rows [T, heads]: the heads of order 2, then 3, ... (HF's order)."""
        k, eos = self.context_len, self.eos
        is_eos = windows[:, :k] == eos
        shifted = [windows[:, k]]
        for s in range(1, self.ngram_size):
            # shift s reads the token s back, or EOS where any of tokens k-s..k-1 is EOS (a segment starts after it)
            crossed = is_eos[:, k - s:].any(dim=1)
            shifted.append(torch.where(crossed, torch.full_like(windows[:, 0], eos), windows[:, k - s]))
        dev = windows.device
        sizes = torch.tensor(self.sizes, dtype=torch.long, device=dev)
        offsets = torch.tensor(self.offsets, dtype=torch.long, device=dev)
        blocks = []
        mixed = shifted[0] * self.multipliers[0]
        for n in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[n - 1] * self.multipliers[n - 1])
            heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            blocks.append(torch.remainder(mixed[:, None], sizes[heads]) + offsets[heads])
        return torch.cat(blocks, dim=-1)
