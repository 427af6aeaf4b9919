"""What each layer keeps per request, and the groups of layers that keep the same (vLLM's KVCacheSpec and KV
cache groups).

A model declares one spec per layer. Layers with equal specs form a group; every group takes its blocks from
the one block pool and has its own block table per request. The pool's block k is a page of the same size in
each of `num_tensors` K/V tensor pairs, and the i-th layer of every group uses pair i: a block belongs to one
group at a time, so groups never touch each other's pages (vLLM's hybrid allocator layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def blocks_held(window: int | None, num_tokens: int, block_size: int, chunk: int) -> int:
    """The most blocks a request of num_tokens tokens holds at once in a group, prefilled `chunk` tokens at a
    time: all of them, or with a window only those of the chunk and of the window - 1 tokens before it."""
    blocks = -(-num_tokens // block_size)
    if window is None:
        return blocks
    return min(blocks, -(-(window - 1 + chunk) // block_size) + 1)


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K and V per token; with a sliding window, a query at position p reads keys (p - W, p]."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    def page_bytes(self, block_size: int) -> int:
        """One layer's K and V for one block."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return blocks_held(self.sliding_window, num_tokens, block_size, chunk)

    def describe(self) -> str:
        kind = "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window}"
        return f"{kind}, {self.num_kv_heads} kv heads x {self.head_dim}, {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class KVCacheGroup:
    spec: AttentionSpec
    layers: tuple[int, ...]


def group_layers(specs: list[AttentionSpec]) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs, grouped in order of first appearance."""
    order: dict[AttentionSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        order.setdefault(spec, []).append(i)
    groups = tuple(KVCacheGroup(spec, tuple(layers)) for spec, layers in order.items())
    pages = {g.spec.page_bytes(1) for g in groups}
    if len(pages) > 1:
        raise NotImplementedError("KV cache groups with different page sizes (kv heads x head dim x dtype) are not "
                                  "supported yet")
    return groups


@dataclass(frozen=True)
class KVCacheLayout:
    """Where each layer's K/V lives and what a block costs."""

    groups: tuple[KVCacheGroup, ...]
    block_size: int

    @property
    def num_tensors(self) -> int:
        return max(len(g.layers) for g in self.groups)

    @property
    def block_bytes(self) -> int:
        return self.num_tensors * self.groups[0].spec.page_bytes(self.block_size)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.spec.sliding_window for g in self.groups)

    def layer_slots(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, tensor pair) of each layer."""
        slots = [(-1, -1)] * num_layers
        for g, group in enumerate(self.groups):
            for i, layer in enumerate(group.layers):
                slots[layer] = (g, i)
        return slots

    def blocks_held(self, num_tokens: int, chunk: int) -> int:
        """Blocks of the pool one request holds at most, over all groups."""
        return sum(g.spec.blocks_held(num_tokens, self.block_size, chunk) for g in self.groups)

    def lines(self) -> list[str]:
        return [f"KV group {i}: {g.spec.describe()}, layers {_ranges(g.layers)}" for i, g in enumerate(self.groups)]


def _ranges(layers: tuple[int, ...]) -> str:
    spans: list[str] = []
    start = prev = layers[0]
    for x in (*layers[1:], None):
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(spans)
