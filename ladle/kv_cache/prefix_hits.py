"""Where a prefix hit can resume: the deepest block boundary that every KV cache group can serve and, for a
model with per-request state, where a state checkpoint is.

What a hit at position P (k full blocks) needs, per kind:
- a full-attention group: its blocks 0..k-1 cached;
- a sliding-window group of window W: only the blocks the next queries read, those holding (P - W, P);
- a compressed group (one entry per `rate` tokens, E entries a block): its complete blocks before entry P // rate;
  the entries of the partly filled one are in the checkpoint;
- state layers and compressed groups: a state checkpoint registered under the node of P.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

from ladle.kv_cache.host_tier import CHECKPOINT

if TYPE_CHECKING:
    from ladle.kv_cache.block_pool import BlockPool
    from ladle.kv_cache.group_tables import GroupTables
    from ladle.kv_cache.host_tier import HostTier
    from ladle.kv_cache.state_checkpoints import StateCheckpoints

NULL_BLOCK = -1  # a table entry given back by a sliding-window group (or never held: a hit past a window)


def host_entry(slot: int) -> int:
    """A hit's entry for a block the host tier holds in `slot` (admission gives it a device block): below -1."""
    return -2 - slot


def host_slot(entry: int) -> int | None:
    """The host slot a hit's entry names, or None for a device block (or NULL_BLOCK)."""
    return -2 - entry if entry < NULL_BLOCK else None


class PrefixHit(NamedTuple):
    # per group: its leading table entries (NULL_BLOCK before a window; host_entry(slot) for one in the host tier)
    blocks: tuple[list[int], ...]
    num_tokens: int  # tokens the hit serves (0: none)
    nodes: tuple[int, ...] = ()  # prefix nodes of its full blocks
    checkpoint: int = -1  # the state checkpoint it resumes from (-1: none needed; host_entry(slot): the host tier's)


def find_hit(nodes: list[int], groups: Sequence[GroupTables], pool: BlockPool, block_size: int,
             checkpoints: StateCheckpoints | None, host: HostTier | None = None,
             host_checkpoints: HostTier | None = None) -> PrefixHit:
    """nodes: the prefix nodes of the request's leading full blocks that the tree knows. checkpoints: where a
    hit also needs a state checkpoint (None: it does not). host, host_checkpoints: the tier that serves the
    blocks and checkpoints the device lost."""

    def lookup(key: tuple[int, int]) -> int | None:
        block = pool.get_cached_block(key)
        if block is None and host is not None:
            slot = host.lookup(key)
            return None if slot is None else host_entry(slot)
        return block

    cached: list[list[int | None]] = []
    for gi, g in enumerate(groups):
        per = g.tokens_per_block // block_size
        cached.append([lookup((nodes[(j + 1) * per - 1], gi))
                       for j in range(len(nodes) * block_size // g.tokens_per_block)])
    # Leading cached blocks per group, and for sliding groups the misses before each block (O(1) range checks).
    leading = [next((j for j, b in enumerate(c) if b is None), len(c)) for c in cached]
    misses = [[0, *accumulate(b is None for b in c)] for c in cached]
    top = len(nodes)
    for g, lead in zip(groups, leading):
        if g.window is None and g.compression == (1, 1):
            top = min(top, lead)
    for k in range(top, 0, -1):
        pos = k * block_size
        checkpoint = -1
        if checkpoints is not None:
            slot = checkpoints.get(nodes[k - 1]) if checkpoints.has(nodes[k - 1]) else None
            if slot is None and host_checkpoints is not None:
                held = host_checkpoints.lookup((nodes[k - 1], CHECKPOINT))
                slot = None if held is None else host_entry(held)
            if slot is None:
                continue
            checkpoint = slot
        blocks = _served(groups, cached, leading, misses, pos, k, block_size)
        if blocks is not None:
            return PrefixHit(blocks, pos, tuple(nodes[:k]), checkpoint)
    return PrefixHit(tuple([] for _ in groups), 0)


def _served(groups: Sequence[GroupTables], cached: list[list[int | None]], leading: list[int],
            misses: list[list[int]], pos: int, k: int, block_size: int) -> tuple[list[int], ...] | None:
    """Each group's table entries for a hit at pos (k blocks), or None if some group cannot serve it."""
    blocks: list[list[int]] = []
    for g, c, lead, miss in zip(groups, cached, leading, misses):
        rate = g.compression[0]
        if g.compression != (1, 1):
            full = (pos // rate) // (g.tokens_per_block // rate)
            if lead < full:
                return None
            blocks.append([b for b in c[:full] if b is not None])
        elif g.window is not None:
            first = g.first_needed(pos, block_size)
            if miss[k] - miss[first]:
                return None
            blocks.append([NULL_BLOCK] * first + [b for b in c[first:k] if b is not None])
        else:
            blocks.append([b for b in c[:k] if b is not None])
    return tuple(blocks)
