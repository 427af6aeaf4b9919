"""Paged KV cache bookkeeping: a pool of fixed-size blocks shared by all layers, block tables, ref counts.

Only ids live here; the tensors live with the model runner. Ref counts exist so prefix caching can share a
block between requests later; today each block has one owner.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_ids)} free; check can_allocate first")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def release(self, ids: list[int]) -> None:
        # Free in reverse so a request's tail blocks are reused first and its head stays cached longest.
        for i in reversed(ids):
            if self.ref_counts[i] <= 0:
                raise RuntimeError(f"block {i} released with ref count {self.ref_counts[i]}")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)


class KVCacheManager:
    """Block tables per request on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request still lacks to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_tables.get(request_id, ())))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold num_tokens tokens; False (and no change) if the pool is short."""
        need = self.num_new_blocks(request_id, num_tokens)
        if need > self.pool.num_free:
            return False
        if need:
            self.block_tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        self.pool.release(self.block_tables.pop(request_id, []))

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
