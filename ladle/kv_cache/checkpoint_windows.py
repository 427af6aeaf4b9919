"""The sliding-window blocks each state checkpoint's hit reads, so a checkpoint goes with its window.

A hit at position P on DeepSeek-V4 needs its window's blocks, those holding (P - W, P), besides the checkpoint.
Once the pool's LRU evicts one of them the checkpoint can serve no hit, so it is evicted with the block and its
slot goes to a checkpoint that can; while it lives, its window is there, in the pool or in the host tier (a block
demoted there keeps its readers, whose hits promote it back). The blocks are not protected beyond
the LRU order: pinning every checkpoint's window (the interval checkpoints' stale windows too) made the pool
evict the compressed blocks that every hit also needs, and measured fewer hits under churn.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ladle.kv_cache.block_pool import BlockPool
    from ladle.kv_cache.group_tables import GroupTables


def window_blocks(groups: Sequence[GroupTables], pool: BlockPool, chain: list[int], position: int,
                  block_size: int) -> list[int]:
    """The cached blocks of every sliding-window group that a hit at position (a block boundary) reads; chain:
    the prefix nodes of the request's full blocks."""
    blocks = []
    for gi, g in enumerate(groups):
        if g.window is None or g.compression != (1, 1):
            continue
        for j in range(g.first_needed(position, block_size), position // block_size):
            block = pool.get_cached_block((chain[j], gi))
            if block is not None:
                blocks.append(block)
    return blocks


class CheckpointWindows:
    def __init__(self) -> None:
        self.by_node: dict[int, list[int]] = {}  # a checkpoint's node -> the window blocks its hit reads
        self.by_block: dict[int, set[int]] = {}  # a window block -> the checkpoint nodes that read it

    def add(self, node: int, blocks: list[int]) -> None:
        self.by_node[node] = blocks
        for b in blocks:
            self.by_block.setdefault(b, set()).add(node)

    def drop(self, node: int) -> None:
        """The checkpoint of node went."""
        for b in self.by_node.pop(node, []):
            nodes = self.by_block[b]
            nodes.discard(node)
            if not nodes:
                del self.by_block[b]

    def forget_block(self, block: int) -> None:
        """The block left the pool but its contents live on (in the host tier): its readers stay, and its id,
        handed to another prefix, no longer speaks for their window."""
        for node in self.by_block.pop(block, ()):
            self.by_node[node].remove(block)

    def readers(self, block: int) -> list[int]:
        """The nodes of the checkpoints whose hit reads block."""
        return sorted(self.by_block.get(block, ()))
