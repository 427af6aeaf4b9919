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

from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

from ladle.kv_cache.host_tier import CHECKPOINT

if TYPE_CHECKING:
    from ladle.kv_cache.block_pool import BlockKey, BlockPool
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

    def lookup(j: int, gi: int) -> int | None:
        return block_entry((nodes[j], gi), pool, host)

    def checkpoint(j: int) -> int | None:
        assert checkpoints is not None
        return checkpoint_entry(nodes[j], checkpoints, host_checkpoints)

    for k, blocks, found in servable(len(nodes), groups, block_size, lookup,
                                     checkpoint if checkpoints is not None else None):
        return PrefixHit(blocks, k * block_size, tuple(nodes[:k]), found)
    return PrefixHit(tuple([] for _ in groups), 0)


def block_entry(key: BlockKey, pool: BlockPool, host: HostTier | None) -> int | None:
    """A hit's table entry for the block cached under key: a device block, a host entry, or None (neither)."""
    block = pool.get_cached_block(key)
    if block is None and host is not None:
        slot = host.lookup(key)
        return None if slot is None else host_entry(slot)
    return block


def checkpoint_entry(node: int, checkpoints: StateCheckpoints, host_checkpoints: HostTier | None) -> int | None:
    """A hit's entry for node's state checkpoint: its device row, a host entry, or None (neither)."""
    slot = checkpoints.get(node) if checkpoints.has(node) else None
    if slot is None and host_checkpoints is not None:
        held = host_checkpoints.lookup((node, CHECKPOINT))
        slot = None if held is None else host_entry(held)
    return slot


def servable(num_blocks: int, groups: Sequence[GroupTables], block_size: int,
             lookup: Callable[[int, int], int | None],
             checkpoint: Callable[[int], int | None] | None) -> Iterator[tuple[int, tuple[list[int], ...], int]]:
    """The hits a prefix of num_blocks full blocks can serve, deepest first: (blocks k, each group's table
    entries, the checkpoint's entry or -1). lookup(j, group): the entry of the group's block registered under
    node j (the j-th token block), None if no tier has it; checkpoint(j): the entry of the checkpoint at node j,
    None if none (checkpoint None: a hit needs no checkpoint). The disk tier asks the same question with its
    own lookups (ladle.kv_cache.disk_hits), so it reads exactly what a hit needs."""
    cached: list[list[int | None]] = []
    for gi, g in enumerate(groups):
        per = g.tokens_per_block // block_size
        cached.append([lookup((j + 1) * per - 1, gi) for j in range(num_blocks * block_size // g.tokens_per_block)])
    # Leading cached blocks per group, and for sliding groups the misses before each block (O(1) range checks).
    leading = [next((j for j, b in enumerate(c) if b is None), len(c)) for c in cached]
    misses = [[0, *accumulate(b is None for b in c)] for c in cached]
    top = num_blocks
    for g, lead in zip(groups, leading):
        if g.window is None and g.compression == (1, 1):
            top = min(top, lead)
    for k in range(top, 0, -1):
        found = -1
        if checkpoint is not None:
            entry = checkpoint(k - 1)
            if entry is None:
                continue
            found = entry
        blocks = _served(groups, cached, leading, misses, k * block_size, k, block_size)
        if blocks is not None:
            yield k, blocks, found


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
