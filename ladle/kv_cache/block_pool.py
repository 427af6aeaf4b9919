"""The paged KV pool's blocks: ref counts, the free queue, and the prefix cache's registry.

Prefix caching (vLLM semantics): a block whose tokens are all written is registered under its BlockKey, the
prefix node of the tokens it holds (ladle.kv_cache.prefix_tree, where exactness lives) and its group. A freed
block keeps its key and stays reusable until the pool needs it; the free queue evicts least recently used
first, and each eviction is reported to on_evict(block id, key), so the node loses the block's reference (or a
host tier keeps the contents under it), and a state checkpoint whose hit reads the block goes with it.

A free cached block whose prefix node a live session keeps (ladle.kv_cache.session_retention) waits in a queue of
its own, evicted only once the plain free queue is empty.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

BlockKey = tuple[int, int]  # (prefix node, KV cache group): the identity of a cached block's contents


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int, BlockKey], None] | None = None,
                 kept: Callable[[int], bool] | None = None) -> None:
        """kept(node): a session keeps the node, so its blocks, once free, are evicted after every other."""
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Blocks with ref count 0, front evicted first. Keys only; an OrderedDict gives O(1) removal when a
        # cached free block is hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.kept_queue: OrderedDict[int, None] = OrderedDict()  # free, cached, kept by a session
        self.kept = kept
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockKey, int] = {}
        self.num_evictions = 0
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.kept_queue)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free} free; check can_allocate first")
        ids = [(self.free_queue or self.kept_queue).popitem(last=False)[0] for _ in range(n)]
        for i in ids:
            self._evict(i)
            self.ref_counts[i] = 1
        return ids

    def touch(self, ids: list[int]) -> None:
        """Take a reference on cached blocks a request hit; a free one leaves the free queue."""
        for i in ids:
            if self.ref_counts[i] == 0 and self.free_queue.pop(i, False) is False:
                del self.kept_queue[i]
            self.ref_counts[i] += 1

    def release(self, ids: list[int]) -> None:
        # In reverse, so a request's tail blocks are evicted before its head, which more requests share.
        for i in reversed(ids):
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} released with ref count {self.ref_counts[i]}")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                key = self.block_keys[i]
                if key is not None and self.kept is not None and self.kept(key[0]):
                    self.kept_queue[i] = None
                    continue
                self.free_queue[i] = None
                if key is None:
                    self.free_queue.move_to_end(i, last=False)  # holds nothing reusable: hand it out first

    def requeue(self, block_id: int, kept: bool) -> None:
        """A session started or stopped keeping the cached block's node: a free block changes queue (one no
        longer kept goes first: its session moved on or lapsed)."""
        if self.ref_counts[block_id]:
            return
        if kept and self.free_queue.pop(block_id, False) is None:
            self.kept_queue[block_id] = None
        elif not kept and self.kept_queue.pop(block_id, False) is None:
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)

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
