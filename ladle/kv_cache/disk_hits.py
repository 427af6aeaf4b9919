"""What a waiting request reads from the disk tier (ladle.kv_cache.disk_tier): the entries only the disk holds of
the deepest hit that the device, the host tier and the disk together can serve.

The hit is chosen by the rules a hit on the device follows (ladle.kv_cache.prefix_hits.servable, the same code):
each group only the blocks a hit reads (a sliding-window group its window's, a compressed group its complete
ones) and, for a model with per-request state or compressed groups, a state checkpoint at the hit's position. So
a read fetches exactly what admission's find_hit then needs from the host tier, and no block a hit could not use
(blocks past the deepest checkpoint on disk serve no hit of such a model).

The reads fill host slots, which may drop the host tier's least recently used entries: a hit that would read more
blocks than the host tier holds beside those of its blocks already there is passed over for a shallower one, so a
fetch never evicts its own hit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ladle.kv_cache.host_tier import CHECKPOINT
from ladle.kv_cache.prefix_hits import NULL_BLOCK, servable

if TYPE_CHECKING:
    from ladle.kv_cache.group_tables import GroupTables

ON_DISK = -(1 << 62)  # a hit's entry only the disk tier holds (below every host entry, which counts down from -2)
Entry = tuple[int, int]  # (token block index whose prefix node names it, KV cache group or CHECKPOINT)


def disk_reads(first: int, num_blocks: int, groups: Sequence[GroupTables], block_size: int,
               lookup: Callable[[int, int], int | None], checkpoint: Callable[[int], int | None] | None,
               on_disk: Callable[[int, int], bool], host_slots: int) -> list[Entry]:
    """The entries to read for the deepest hit past `first` blocks, among a prefix of num_blocks full blocks; []
    when none serves deeper. lookup(j, group), checkpoint(j): the device's or host tier's entry under the node of
    token block j, or None (find_hit's; checkpoint None: a hit needs none); on_disk(j, group or CHECKPOINT)."""

    def block(j: int, gi: int) -> int | None:
        entry = lookup(j, gi)
        return ON_DISK if entry is None and on_disk(j, gi) else entry

    def state(j: int) -> int | None:
        assert checkpoint is not None
        entry = checkpoint(j)
        return ON_DISK if entry is None and on_disk(j, CHECKPOINT) else entry

    # A hit runs no deeper than the leading blocks every full-attention group finds in some tier: scanning from
    # the device's hit on, a request with nothing on disk costs a lookup or two a step, however long its prompt.
    full = [gi for gi, g in enumerate(groups) if g.window is None and g.compression == (1, 1)]
    top = num_blocks
    if full:
        top = first
        while top < num_blocks and all(block(top, gi) is not None for gi in full):
            top += 1
    if top <= first:
        return []
    for k, blocks, found in servable(top, groups, block_size, block, state if checkpoint is not None else None):
        if k <= first:
            break
        reads = []
        hosted = 0
        for gi, (g, table) in enumerate(zip(groups, blocks)):
            per = g.tokens_per_block // block_size
            for i, entry in enumerate(table):
                if entry == ON_DISK:
                    reads.append(((i + 1) * per - 1, gi))
                elif entry < NULL_BLOCK:
                    hosted += 1
        if len(reads) + hosted > host_slots:
            continue
        if found == ON_DISK:
            reads.append((k - 1, CHECKPOINT))
        return reads
    return []
