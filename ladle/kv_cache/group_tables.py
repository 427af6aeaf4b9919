"""One KV cache group's side of the KV manager: each request's block table in it, and how far its blocks are
registered in the prefix cache."""
from __future__ import annotations

from ladle.kv_cache.specs import blocks_held


class GroupTables:
    def __init__(self, window: int | None, compression: tuple[int, int], block_size: int) -> None:
        self.window = window
        self.compression = compression
        rate, scale = compression
        # Tokens whose KV (or entries) one of its blocks holds.
        self.tokens_per_block = block_size * scale * rate
        self.tables: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}  # per request: leading blocks registered or found registered

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks that hold num_tokens tokens (or, compressed, the entries of their complete groups)."""
        return blocks_held(None, num_tokens, block_size, num_tokens, self.compression)

    def first_needed(self, num_computed: int, block_size: int) -> int:
        """Index of the first block the next queries (from position num_computed) can read."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size

    def tail_block(self, position: int) -> int | None:
        """Index of a compressed group's partly filled block at position, whose entries a state checkpoint
        holds; None for an uncompressed group or when every block before position is complete."""
        rate = self.compression[0]
        if self.compression == (1, 1):
            return None
        entries, per_block = position // rate, self.tokens_per_block // rate
        return entries // per_block if entries % per_block else None
