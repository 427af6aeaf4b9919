"""The paged KV pool's blocks: ref counts, the free queue, and the prefix cache's registry.

Prefix caching (vLLM semantics): a block whose tokens are all written is registered under a BlockHash, the
identity of its KV: its parent block's identity and its own token ids. A freed block keeps its hash and
stays reusable until the pool needs it; the free queue evicts least recently used first. Hits are exact: the
dict compares token ids and the parent's cache id on every hit, and cache ids are never reused, so no hash
collision (even a constant hash) can serve another prefix's KV.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

ROOT_CACHE_ID = -1  # parent of a request's first block


def hash_block_tokens(parent_cache_id: int, tokens_hash: int, extra_keys: tuple) -> int:
    """Hash of a block's identity. A module function, so tests can make it collide on purpose."""
    return hash((parent_cache_id, tokens_hash, extra_keys))


@dataclass(frozen=True)
class BlockTokens:
    """A full block's token ids and their hash, made once per request and block (Request.block_tokens), so
    the lookups each step repeats for a waiting prompt hash only the parent's id."""

    token_ids: tuple[int, ...]
    tokens_hash: int


@dataclass(frozen=True, eq=True)
class BlockHash:
    """A full block's identity. The parent is named by its cache id (unique for the pool's lifetime)
    rather than by its hash, so equality of two BlockHashes means equality of the whole prefix."""

    parent_cache_id: int
    tokens: BlockTokens
    extra_keys: tuple = ()  # anything else that changes KV (an adapter id, one day)

    def __hash__(self) -> int:
        return hash_block_tokens(self.parent_cache_id, self.tokens.tokens_hash, self.extra_keys)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Blocks with ref count 0, front evicted first. Keys only; an OrderedDict gives O(1) removal when a
        # cached free block is hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cache_ids: list[int] = [ROOT_CACHE_ID] * num_blocks
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}
        self._next_cache_id = itertools.count()
        self.num_evictions = 0

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
                if self.block_hashes[i] is None:
                    self.free_queue.move_to_end(i, last=False)  # holds nothing reusable: hand it out first

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> int:
        """Register a written block under block_hash; returns the cache id that names this prefix. If an
        identical block is registered already (two requests computed it at once), that one keeps the entry."""
        existing = self.cached_block_hash_to_block.get(block_hash)
        if existing is not None:
            return self.cache_ids[existing]
        self.cached_block_hash_to_block[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        self.cache_ids[block_id] = next(self._next_cache_id)
        return self.cache_ids[block_id]

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        del self.cached_block_hash_to_block[block_hash]
        self.block_hashes[block_id] = None
        self.cache_ids[block_id] = ROOT_CACHE_ID
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); refused (False) while any block is in use."""
        if any(self.ref_counts):
            return False
        for block_id in range(self.num_blocks):
            self._evict(block_id)
        return True

    @property
    def num_cached(self) -> int:
        return len(self.cached_block_hash_to_block)
