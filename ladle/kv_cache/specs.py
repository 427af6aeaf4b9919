"""What each layer keeps per request, and the groups of layers that keep the same (vLLM's KVCacheSpec and KV
cache groups).

A model declares one spec per layer. Layers with equal specs form a group. Paged groups (AttentionSpec) take
their blocks from the one block pool and have their own block table per request. The pool's block k is a
page of the same size in each of `num_tensors` K/V tensor pairs, and the i-th layer of every paged group uses
pair i: a block belongs to one group at a time, so groups never touch each other's pages (vLLM's hybrid
allocator layout). State groups (StateSpec) keep a fixed-size slot per running request instead (a recurrent
or convolution state, whatever the prompt's length): each of their layers has its own slot tensors, and a
request holds the same slot index in all of them from admission to finish or preemption.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ladle.config.sizes import format_bytes


def blocks_held(window: int | None, num_tokens: int, block_size: int, chunk: int,
                compression: tuple[int, int] = (1, 1)) -> int:
    """The most blocks a request of num_tokens tokens holds at once in a group, prefilled `chunk` tokens at a
    time: all of them, or with a window only those of the chunk and of the window - 1 tokens before it. A
    compressed group (rate, scale) holds one entry per `rate` complete tokens, block_size x scale a block (rate 1:
    an entry per token, narrower than a K/V row, so more of them to a page)."""
    rate, scale = compression
    if compression != (1, 1):
        return -(-(num_tokens // rate) // (block_size * scale))
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
    kv_shared: bool = False  # one vector per token is both key and value (DeepSeek-V4): one tensor, not two
    # A compressed group keeps one entry per compress_rate tokens (DeepSeek-V4's compressed KV), paged by
    # entry position; block_scale x block_size entries to a block, so narrower entries fill the same page. The
    # model writes a compressed group's entries itself (its slot mapping is empty).
    compress_rate: int = 1
    block_scale: int = 1
    label: str = ""  # what the entries are, where the fields alone would not say (the plan's KV group line)

    @property
    def compression(self) -> tuple[int, int]:
        return self.compress_rate, self.block_scale

    def page_bytes(self, block_size: int) -> int:
        """One layer's K and V (or entries) for one block."""
        entries = block_size * self.block_scale
        return (1 if self.kv_shared else 2) * entries * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return blocks_held(self.sliding_window, num_tokens, block_size, chunk, self.compression)

    def describe(self) -> str:
        kind = "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window}"
        if self.compression != (1, 1):
            kind = f"compressed entries (1 per {self.compress_rate} tokens, {self.block_scale}x16 a block)"
        if self.label:
            kind = f"{self.label} ({self.block_scale}x16 tokens a block)"
        shared = ", key = value" if self.kv_shared else ""
        return (f"{kind}, {self.num_kv_heads} kv heads x {self.head_dim}{shared}, "
                f"{str(self.dtype).removeprefix('torch.')}")


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size state per request and layer, not paged by token: tensors of these shapes and dtypes (for
    a Gated DeltaNet layer: the convolution's last inputs and the recurrent state)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kind: str = "recurrent state"

    @property
    def bytes_per_request(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def describe(self) -> str:
        shapes = " + ".join(f"{'x'.join(map(str, s))} {str(d).removeprefix('torch.')}"
                            for s, d in zip(self.shapes, self.dtypes))
        return f"{self.kind}, {shapes} ({format_bytes(self.bytes_per_request)} per request and layer)"


CacheSpec = AttentionSpec | StateSpec


@dataclass(frozen=True)
class KVCacheGroup:
    spec: AttentionSpec
    layers: tuple[int, ...]


def paged_group(window: int | None = None, compression: tuple[int, int] = (1, 1),
                layers: tuple[int, ...] = (0,)) -> KVCacheGroup:
    """A group of one-head fp32 layers: what the KV manager and the input builders need where only the window
    and the compression matter (their defaults, and tests)."""
    return KVCacheGroup(AttentionSpec(1, 1, torch.float32, window, compress_rate=compression[0],
                                      block_scale=compression[1]), layers)


@dataclass(frozen=True)
class StateGroup:
    spec: StateSpec
    layers: tuple[int, ...]


def group_layers(specs: Sequence[CacheSpec]) -> tuple[KVCacheGroup, ...]:
    """The paged layers with equal specs, grouped in order of first appearance."""
    groups = tuple(KVCacheGroup(spec, layers) for spec, layers in _by_spec(specs, AttentionSpec).items())
    pages = {g.spec.page_bytes(1) for g in groups}
    if len(pages) > 1 or len({g.spec.kv_shared for g in groups}) > 1:
        raise NotImplementedError("KV cache groups with different page sizes (kv heads x head dim x dtype) are not "
                                  "supported yet")
    return groups


def _by_spec(specs: Sequence[CacheSpec], kind: type) -> dict:
    order: dict[CacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, kind):
            order.setdefault(spec, []).append(i)
    return {spec: tuple(layers) for spec, layers in order.items()}


def layer_groups(specs: Sequence[CacheSpec]) -> list[int]:
    """Each layer's index into the step's metadata: the paged groups first, then the state groups, each in
    order of first appearance (the order KVCacheLayout.of gives them)."""
    index: dict[CacheSpec, int] = {}
    for kind in (AttentionSpec, StateSpec):
        for spec in _by_spec(specs, kind):
            index[spec] = len(index)
    return [index[s] for s in specs]


@dataclass(frozen=True)
class KVCacheLayout:
    """Where each layer's K/V (or state) lives and what a block (or a request's state) costs."""

    groups: tuple[KVCacheGroup, ...]  # paged
    block_size: int
    state_groups: tuple[StateGroup, ...] = ()

    @classmethod
    def of(cls, specs: Sequence[CacheSpec], block_size: int) -> KVCacheLayout:
        """The layout of a model whose layer i keeps specs[i]."""
        if not any(isinstance(s, AttentionSpec) for s in specs):
            raise NotImplementedError("a model with no attention layer (state only) is not supported yet")
        states = tuple(StateGroup(spec, layers) for spec, layers in _by_spec(specs, StateSpec).items())
        return cls(group_layers(specs), block_size, states)

    @property
    def num_layers(self) -> int:
        groups: tuple[KVCacheGroup | StateGroup, ...] = (*self.groups, *self.state_groups)
        return 1 + max(layer for g in groups for layer in g.layers)

    @property
    def state_bytes_per_request(self) -> int:
        """One request's slot over all state layers."""
        return sum(g.spec.bytes_per_request * len(g.layers) for g in self.state_groups)

    @property
    def tail_groups(self) -> tuple[int, ...]:
        """The compressed groups, whose last partly filled block a state checkpoint holds a copy of."""
        return tuple(i for i, g in enumerate(self.groups) if g.spec.compression != (1, 1))

    def checkpoint_bytes(self, block_size: int) -> int:
        """One state checkpoint: a request's state slot, and a page per layer of each compressed group."""
        return self.state_bytes_per_request + sum(
            len(self.groups[i].layers) * self.groups[i].spec.page_bytes(block_size) for i in self.tail_groups)

    @property
    def num_tensors(self) -> int:
        return max(len(g.layers) for g in self.groups)

    @property
    def block_bytes(self) -> int:
        return self.num_tensors * self.groups[0].spec.page_bytes(self.block_size)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.spec.sliding_window for g in self.groups)

    @property
    def compressions(self) -> tuple[tuple[int, int], ...]:
        """Each paged group's (tokens per entry, block scale); (1, 1) for a group that keeps every token."""
        return tuple(g.spec.compression for g in self.groups)

    def layer_slots(self, num_layers: int) -> list[tuple[int, int]]:
        """(paged group, tensor pair) of each paged layer; (-1, -1) for a state layer."""
        slots = [(-1, -1)] * num_layers
        for g, group in enumerate(self.groups):
            for i, layer in enumerate(group.layers):
                slots[layer] = (g, i)
        return slots

    def blocks_held(self, num_tokens: int, chunk: int) -> int:
        """Blocks of the pool one request holds at most, over all groups."""
        return sum(g.spec.blocks_held(num_tokens, self.block_size, chunk) for g in self.groups)

    def lines(self) -> list[str]:
        paged = [f"KV group {i}: {g.spec.describe()}, layers {_ranges(g.layers)}" for i, g in enumerate(self.groups)]
        return paged + [f"state group {i}: {g.spec.describe()}, layers {_ranges(g.layers)}"
                        for i, g in enumerate(self.state_groups)]


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
