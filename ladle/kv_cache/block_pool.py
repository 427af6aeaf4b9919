"""The paged KV pool's blocks: ref counts, the free queue, and the prefix cache's registry.

Prefix caching (vLLM semantics): a block whose tokens are all written is registered under its BlockKey, the
prefix node of the tokens it holds (ladle.kv_cache.prefix_tree, where exactness lives) and its group. A freed
block keeps its key and stays reusable until the pool needs it; the free queue evicts least recently used
first, and each eviction is reported to on_evict(block id, key), so the node loses the block's reference (or a
host tier keeps the contents under it), and a state checkpoint whose hit reads the block goes with it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

BlockKey = tuple[int, int]  # (prefix node, KV cache group): the identity of a cached block's contents


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int, BlockKey], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Blocks with ref count 0, front evicted first. Keys only; an OrderedDict gives O(1) removal when a
        # cached free block is hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockKey, int] = {}
        self.num_evictions = 0
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free; check can_allocate first")
        ids = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for i in ids:
            self._evict(i)
            self.ref_counts[i] = 1
        return ids

    def touch(self, ids: list[int]) -> None:
        """Take a reference on cached blocks a request hit; a free one leaves the free queue."""
        for i in ids:
            if self.ref_counts[i] == 0:
                del self.free_queue[i]
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> None:
        # In reverse, so a request's tail blocks are evicted before its head, which more requests share.
        for i in reversed(ids):
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} released with ref count {self.ref_counts[i]}")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_queue[i] = None
                if self.block_keys[i] is None:
                    self.free_queue.move_to_end(i, last=False)  # holds nothing reusable: hand it out first

    def get_cached_block(self, key: BlockKey) -> int | None:
        return self.cached_blocks.get(key)

    def cache_block(self, block_id: int, key: BlockKey) -> bool:
        """Register a written block under key; False if an identical block is registered already (two requests
        computed it at once): that one keeps the entry."""
        if key in self.cached_blocks:
            return False
        self.cached_blocks[key] = block_id
        self.block_keys[block_id] = key
        return True

    def _evict(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is None:
            return
        del self.cached_blocks[key]
        self.block_keys[block_id] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block_id, key)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); refused (False) while any block is in use."""
        if any(self.ref_counts):
            return False
        for block_id in range(self.num_blocks):
            self._evict(block_id)
        return True

    @property
    def num_cached(self) -> int:
        return len(self.cached_blocks)
