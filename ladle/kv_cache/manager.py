"""Block tables per request and per KV cache group, on one BlockPool, and the prefix cache.

Only ids live here; the tensors live with the model runner. Groups differ in what a request holds: a
full-attention group keeps a block for every block of its tokens; a sliding-window group of window W gives a
block back once it lies wholly before position p - W + 1, where p is the first position the request will
compute next, leaving NULL_BLOCK in its table (no kernel reads that far back).

Invariants:
- A block is registered only after the step that wrote its last token has run (cache_full_blocks is called
  with num_computed_tokens), so a partly written block is never served; a sliding group gives a block back
  only after that, so every block it ever held was registered first.
- A registered block is never written again: a request writes only at positions >= num_computed_tokens,
  which lie past its hit, and the hit stops short of the last token (see get_computed_blocks).
- A prefix hit is the longest one every group can serve: each group walks its chain of registered blocks
  from the first, so a sliding group serves a hit only while all its blocks up to the hit are still cached
  (stricter than the window needs, never wrong).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ladle.kv_cache.block_pool import ROOT_CACHE_ID, BlockHash, BlockPool, BlockTokens
from ladle.kv_cache.specs import KVCacheGroup, blocks_held, paged_group

if TYPE_CHECKING:
    from ladle.request import Request

NULL_BLOCK = -1  # a table entry given back by a sliding-window group
GroupBlocks = tuple[list[int], ...]  # one list per group


class _GroupTables:
    def __init__(self, window: int | None, compression: tuple[int, int] = (1, 1)) -> None:
        self.window = window
        self.compression = compression
        self.tables: dict[str, list[int]] = {}
        # Per request: how many leading blocks are registered (or found registered), and the cache id of the
        # last of them, which is the parent of the next one.
        self.num_cached_block: dict[str, int] = {}
        self.last_cache_id: dict[str, int] = {}

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks that hold num_tokens tokens (or, compressed, the entries of their complete groups)."""
        return blocks_held(None, num_tokens, block_size, num_tokens, self.compression)

    def first_needed(self, num_computed: int, block_size: int) -> int:
        """Index of the first block the next queries (from position num_computed) can read."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] | None = None, num_state_slots: int = 0) -> None:
        """groups: the layout's paged groups (KVCacheLayout.groups; one full-attention group if None), whose
        specs say each one's window and compression. num_state_slots: for a model with state layers, the slots
        its state tensors hold (one per running request); a request takes one at admission and gives it back
        when freed."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        specs = [g.spec for g in (groups or (paged_group(),))]
        self.groups = [_GroupTables(s.sliding_window, s.compression) for s in specs]
        self.tables = tuple(g.tables for g in self.groups)
        self.has_sliding_window = any(s.sliding_window is not None for s in specs)
        if enable_caching and any(g.compression != (1, 1) for g in self.groups):
            raise ValueError("prefix caching cannot serve compressed KV groups (their blocks hold entries, not "
                             "tokens)")
        self.state_slots: dict[str, int] = {}
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._uses_state = num_state_slots > 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now, cached-but-unreferenced ones included."""
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Blocks a request of num_tokens tokens holds at most, prefilled `chunk` tokens at a time."""
        return sum(blocks_held(g.window, num_tokens, self.block_size, chunk, g.compression) for g in self.groups)

    def held_blocks(self, request_id: str) -> int:
        return sum(sum(b != NULL_BLOCK for b in g.tables.get(request_id, ())) for g in self.groups)

    def block_ids(self, request_id: str) -> GroupBlocks:
        return tuple(g.tables.get(request_id, []) for g in self.groups)

    def _block_tokens(self, request: Request, num_blocks: int) -> list[BlockTokens]:
        """The request's first num_blocks full blocks' tokens, each made once: tokens are only ever appended."""
        made, size, ids = request.block_tokens, self.block_size, request.all_token_ids
        for i in range(len(made), num_blocks):
            block = tuple(ids[i * size : (i + 1) * size])
            made.append(BlockTokens(block, hash(block)))
        return made

    @staticmethod
    def _block_hash(parent_cache_id: int, tokens: BlockTokens, group: int) -> BlockHash:
        """Groups hold different layers' KV for the same tokens, so the group is part of a block's identity."""
        return BlockHash(parent_cache_id, tokens, () if group == 0 else (group,))

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Each group's leading cached blocks of the request and the tokens they hold. The hit stops before
        the last token, so logits exist; a block-aligned prompt therefore recomputes its last block into a
        block of its own, and a shared block is never written."""
        empty: GroupBlocks = tuple([] for _ in self.groups)
        if not self.enable_caching:
            return empty, 0
        hits: list[list[int]] = []
        keys = self._block_tokens(request, (request.num_tokens - 1) // self.block_size)
        for gi in range(len(self.groups)):
            blocks: list[int] = []
            parent = ROOT_CACHE_ID
            for tokens in keys:
                block_id = self.pool.get_cached_block(self._block_hash(parent, tokens, gi))
                if block_id is None:
                    break
                blocks.append(block_id)
                parent = self.pool.cache_ids[block_id]
            hits.append(blocks)
        # A hit only where every group can serve it (one group's blocks may be evicted before another's).
        n = min(len(b) for b in hits)
        return tuple(b[:n] for b in hits), n * self.block_size

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed_blocks: GroupBlocks = (),
                               num_computed: int = 0) -> int:
        """Free blocks that granting num_tokens would use: new blocks, plus hit blocks that sit in the free
        queue (taking them shrinks it), less the blocks a sliding group gives back first. Hit blocks another
        request holds cost nothing."""
        return self._need(request_id, [num_tokens] * len(self.groups), computed_blocks, num_computed)

    def _need(self, request_id: str, ends: list[int], computed_blocks: GroupBlocks, num_computed: int) -> int:
        total = 0
        for gi, g in enumerate(self.groups):
            table = g.tables.get(request_id, [])
            hit = computed_blocks[gi] if computed_blocks else []
            first = g.first_needed(num_computed, self.block_size)
            new = max(0, g.blocks_for(ends[gi], self.block_size) - max(len(table) + len(hit), first))
            back = sum(1 for b in table[:first] if b != NULL_BLOCK and self.pool.ref_counts[b] == 1)
            total += new + sum(1 for b in hit if self.pool.ref_counts[b] == 0) - back
        return total

    def allocate(self, request_id: str, num_tokens: int, computed_blocks: GroupBlocks = (),
                 num_computed: int = 0) -> bool:
        """Grow the request's tables to cover num_tokens tokens, starting with computed_blocks (its prefix hit)
        when it has no tables yet; num_computed is where the request's next queries start, so sliding groups
        first give back the blocks before their window. False (and no change) if the pool is short."""
        if not computed_blocks and not self.has_sliding_window and request_id in self.groups[0].tables:
            # A running request in full-attention groups (every decode step): usually no block is due.
            due = [max(0, g.blocks_for(num_tokens, self.block_size) - len(g.tables[request_id]))
                   for g in self.groups]
            if sum(due) == 0:
                return True
            if sum(due) > self.pool.num_free:
                return False
            for g, n in zip(self.groups, due):
                if n:
                    g.tables[request_id].extend(self.pool.allocate(n))
            return True
        return self._grow(request_id, [num_tokens] * len(self.groups), computed_blocks, num_computed, 0)

    def admit(self, request_id: str, num_tokens: int, first_chunk_end: int, chunk: int,
              computed_blocks: GroupBlocks = (), num_computed: int = 0) -> bool:
        """Admission on the whole prompt: full-attention groups get blocks for all num_tokens now; a sliding
        group gets those of its first chunk, and only if the pool also has room for it to grow to the most it
        will hold (prefilling `chunk` tokens a step), so an admitted prompt does not stall between chunks."""
        if self._uses_state and request_id not in self.state_slots and not self._free_slots:
            return False
        ends = [num_tokens if g.window is None else first_chunk_end for g in self.groups]
        room = sum(max(0, blocks_held(g.window, num_tokens, self.block_size, chunk) - self.blocks_for(first_chunk_end))
                   for g in self.groups if g.window is not None)
        if not self._grow(request_id, ends, computed_blocks, num_computed, room):
            return False
        if self._uses_state and request_id not in self.state_slots:
            self.state_slots[request_id] = self._free_slots.pop()
        return True

    def _grow(self, request_id: str, ends: list[int], computed_blocks: GroupBlocks, num_computed: int,
              room: int) -> bool:
        if self._need(request_id, ends, computed_blocks, num_computed) + room > self.pool.num_free:
            return False
        # Every group's hit leaves the free queue before any group allocates: otherwise one group's new blocks
        # could be another group's hit blocks, evicted and handed out while that group takes them as cached.
        for gi, g in enumerate(self.groups):
            hit = computed_blocks[gi] if computed_blocks else []
            if hit:
                table = g.tables.setdefault(request_id, [])
                assert not table, "a prefix hit only starts an empty table"
                self.pool.touch(list(hit))
                table.extend(hit)
                g.num_cached_block[request_id] = len(hit)
                g.last_cache_id[request_id] = self.pool.cache_ids[hit[-1]]
        for gi, g in enumerate(self.groups):
            table = g.tables.setdefault(request_id, [])
            first = g.first_needed(num_computed, self.block_size)
            for i in range(min(first, len(table))):
                if table[i] != NULL_BLOCK:
                    self.pool.release([table[i]])
                    table[i] = NULL_BLOCK
            if len(table) < first:
                table.extend([NULL_BLOCK] * (first - len(table)))
            need = g.blocks_for(ends[gi], self.block_size) - len(table)
            if need > 0:
                table.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that num_computed_tokens has filled. Call after the step ran."""
        if not self.enable_caching:
            return
        rid = request.request_id
        end = num_computed_tokens // self.block_size
        keys: list[BlockTokens] | None = None  # made only on a step that fills a block (most fill none)
        for gi, g in enumerate(self.groups):
            table = g.tables.get(rid)
            start = g.num_cached_block.get(rid, 0)
            if table is None or end <= start:
                continue
            keys = keys or self._block_tokens(request, end)
            parent = g.last_cache_id.get(rid, ROOT_CACHE_ID)
            for i in range(start, end):
                if table[i] == NULL_BLOCK:
                    break  # never held (a window passed it over): the chain cannot go on
                parent = self.pool.cache_block(table[i], self._block_hash(parent, keys[i], gi))
                g.num_cached_block[rid] = i + 1
            g.last_cache_id[rid] = parent

    def free(self, request_id: str) -> None:
        """Drop the request's references (its state slot too); its registered blocks stay cached until
        evicted."""
        slot = self.state_slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        for g in self.groups:
            self.pool.release([b for b in g.tables.pop(request_id, []) if b != NULL_BLOCK])
            g.num_cached_block.pop(request_id, None)
            g.last_cache_id.pop(request_id, None)
