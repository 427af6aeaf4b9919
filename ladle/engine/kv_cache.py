"""Paged KV cache bookkeeping: a pool of fixed-size blocks shared by all layers, block tables, ref counts,
and the prefix cache.

Only ids live here; the tensors live with the model runner.

Prefix caching (vLLM semantics): a block whose tokens are all written is registered under a BlockHash, the
identity of its KV: its parent block's identity and its own token ids. A new request reuses its leading
registered blocks (ref count + 1) and prefills from the first uncached token. A freed block keeps its hash
and stays reusable until the pool needs it; the free queue evicts least recently used first.

Invariants:
- A block is registered only after the step that wrote its last token has run (cache_full_blocks is called
  with num_computed_tokens), so a partly written block is never served.
- A registered block is never written again: a request writes only at positions >= num_computed_tokens,
  which lie past its hit, and the hit stops short of the last token (see get_computed_blocks).
- Hits are exact: the dict compares token ids and the parent's cache id on every hit, and cache ids are
  never reused, so no hash collision (even a constant hash) can serve another prefix's KV.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ladle.request import Request

ROOT_CACHE_ID = -1  # parent of a request's first block


def hash_block_tokens(parent_cache_id: int, token_ids: tuple[int, ...], extra_keys: tuple) -> int:
    """Hash of a block's identity. A module function, so tests can make it collide on purpose."""
    return hash((parent_cache_id, token_ids, extra_keys))


@dataclass(frozen=True, eq=True)
class BlockHash:
    """A full block's identity. The parent is named by its cache id (unique for the pool's lifetime)
    rather than by its hash, so equality of two BlockHashes means equality of the whole prefix."""

    parent_cache_id: int
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()  # anything else that changes KV (an adapter id, one day)

    def __hash__(self) -> int:
        return hash_block_tokens(self.parent_cache_id, self.token_ids, self.extra_keys)


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

    @property
    def num_cached(self) -> int:
        return len(self.cached_block_hash_to_block)


class KVCacheManager:
    """Block tables per request on top of a BlockPool, and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        # Per request: how many leading blocks are registered (or found registered), and the cache id of
        # the last of them, which is the parent of the next one.
        self.num_cached_block: dict[str, int] = {}
        self.last_cache_id: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now, cached-but-unreferenced ones included."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hash(self, parent_cache_id: int, token_ids: list[int], index: int) -> BlockHash:
        start = index * self.block_size
        return BlockHash(parent_cache_id, tuple(token_ids[start : start + self.block_size]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The request's leading cached blocks and the tokens they hold. The hit stops before the last
        token, so logits exist; a block-aligned prompt therefore recomputes its last block into a block of
        its own, and a shared block is never written."""
        if not self.enable_caching:
            return [], 0
        blocks: list[int] = []
        parent = ROOT_CACHE_ID
        for i in range((request.num_tokens - 1) // self.block_size):
            block_id = self.pool.get_cached_block(self._block_hash(parent, request.all_token_ids, i))
            if block_id is None:
                break
            blocks.append(block_id)
            parent = self.pool.cache_ids[block_id]
        return blocks, len(blocks) * self.block_size

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks that granting num_tokens would use: new blocks, plus hit blocks that sit in the free
        queue (taking them shrinks it). Hit blocks another request holds cost nothing."""
        have = len(self.block_tables.get(request_id, ())) + len(computed_blocks)
        new = max(0, self.blocks_for(num_tokens) - have)
        return new + sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Grow the request's table to hold num_tokens tokens, starting with computed_blocks (its prefix
        hit) when it has no table yet; False (and no change) if the pool is short."""
        table = self.block_tables.get(request_id)
        if table is not None and not computed_blocks:
            # A running request (every decode step): usually its last block still has room.
            need = self.blocks_for(num_tokens) - len(table)
            if need > 0:
                if need > self.pool.num_free:
                    return False
                table.extend(self.pool.allocate(need))
            return True
        if self.num_blocks_to_allocate(request_id, num_tokens, computed_blocks) > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if computed_blocks:
            assert not table, "a prefix hit only starts an empty table"
            self.pool.touch(list(computed_blocks))
            table.extend(computed_blocks)
            self.num_cached_block[request_id] = len(computed_blocks)
            self.last_cache_id[request_id] = self.pool.cache_ids[computed_blocks[-1]]
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that num_computed_tokens has filled. Call after the step ran."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            return
        start = self.num_cached_block.get(rid, 0)
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        parent = self.last_cache_id.get(rid, ROOT_CACHE_ID)
        for i in range(start, end):
            parent = self.pool.cache_block(table[i], self._block_hash(parent, request.all_token_ids, i))
        self.num_cached_block[rid] = end
        self.last_cache_id[rid] = parent

    def free(self, request_id: str) -> None:
        """Drop the request's references; its registered blocks stay cached until evicted."""
        self.pool.release(self.block_tables.pop(request_id, []))
        self.num_cached_block.pop(request_id, None)
        self.last_cache_id.pop(request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
