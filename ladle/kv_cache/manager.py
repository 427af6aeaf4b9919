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
- A prefix hit is the deepest block boundary every group can serve (ladle.kv_cache.prefix_hits): a full group
  with all its blocks before it cached, a sliding group with those its window reads, a compressed group with
  its complete blocks, and a model with per-request state (or compressed groups, whose last partial block is
  in the checkpoint) with a state checkpoint there. Blocks and checkpoints are registered under prefix nodes
  (ladle.kv_cache.prefix_tree), so each is found without the others.
- With a disk tier (ladle.kv_cache.disk_tier), every block and checkpoint registered is also written to disk, and
  a prefix that continues on disk past the device and host tiers is read back into host slots (what its deepest
  hit needs: ladle.kv_cache.disk_hits) before its request is admitted.
- A request that names its session (Request.session_id) leaves its prefix nodes and its deepest checkpoint kept
  for that session when it ends (ladle.kv_cache.session_retention): blocks and host entries under those nodes,
  and that checkpoint, are evicted after every other. Keeping reorders eviction only.
- A checkpoint is registered only after the forward that reached its position has run and copied the state
  (cache_full_blocks again); a request holds at most one pending checkpoint, freed with the request. A
  registered checkpoint is evicted with any window block its hit reads (ladle.kv_cache.checkpoint_windows).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ladle.kv_cache.block_pool import BlockKey, BlockPool
from ladle.kv_cache.checkpoint_windows import CheckpointWindows, window_blocks
from ladle.kv_cache.disk_hits import disk_reads
from ladle.kv_cache.disk_tier import DiskRead, DiskTier
from ladle.kv_cache.group_tables import GroupTables
from ladle.kv_cache.host_tier import CHECKPOINT, HostTier
from ladle.kv_cache.prefix_hits import NULL_BLOCK, PrefixHit, block_entry, checkpoint_entry, find_hit, host_slot
from ladle.kv_cache.prefix_tree import ROOT, BlockTokens, PrefixTree
from ladle.kv_cache.session_retention import SESSION_TTL_S, SessionRetention
from ladle.kv_cache.specs import KVCacheGroup, blocks_held, paged_group
from ladle.kv_cache.state_checkpoints import CheckpointCopy, StateCheckpoints

if TYPE_CHECKING:
    from ladle.request import Request

GroupBlocks = tuple[list[int], ...]  # one list per group


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] | None = None, num_state_slots: int = 0,
                 num_checkpoints: int = 0, checkpoint_bytes: int = 0, host_slots: int = 0,
                 disk: DiskTier | None = None, host_checkpoints: int = 0,
                 session_ttl_s: float = SESSION_TTL_S) -> None:
        """groups: the layout's paged groups (KVCacheLayout.groups; one full-attention group if None), whose
        specs say each one's window and compression. num_state_slots: for a model with state layers, the slots
        its state tensors hold (one per running request); a request takes one at admission and gives it back
        when freed. num_checkpoints: state checkpoints, in the state tensors' rows after those slots
        (checkpoint_bytes each); prefix caching needs them for a model with state layers or compressed groups.
        host_slots: blocks of the prefix cache's host tier (ladle.kv_cache.host_tier; 0: none). disk: the tier
        below it (its reads fill host slots, so it needs one, and checkpoint slots where hits need checkpoints).
        host_checkpoints: the host tier's state checkpoints (a HostTier of their own; 0: none). session_ttl_s: how
        long a session's prefix stays kept after its last request ended."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tree = PrefixTree()
        self.sessions = SessionRetention(self._kept_changed, session_ttl_s)
        kept = self.sessions.kept
        self.pool = BlockPool(num_blocks, on_evict=self._block_evicted, kept=kept)
        self.host = HostTier(host_slots, self.tree.unref, kept) if enable_caching and host_slots else None
        if disk is not None and self.host is None:
            raise ValueError("the KV disk tier reads into host slots: it needs prefix caching and a host tier")
        self.disk = disk
        self.windows = CheckpointWindows()
        specs = [g.spec for g in (groups or (paged_group(),))]
        self.groups = [GroupTables(s.sliding_window, s.compression, block_size) for s in specs]
        self.tables = tuple(g.tables for g in self.groups)
        self.has_sliding_window = any(s.sliding_window is not None for s in specs)
        self.state_slots: dict[str, int] = {}
        self._free_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._uses_state = num_state_slots > 0
        # With state layers or compressed groups a hit must restore what the paged pool does not hold.
        self.checkpointing = enable_caching and (self._uses_state or any(g.compression != (1, 1)
                                                                         for g in self.groups))
        if self.checkpointing and num_checkpoints < 1:
            raise ValueError("prefix caching on a model with per-request state or compressed KV groups needs "
                             "state checkpoints (num_checkpoints >= 1)")
        self.checkpoints = StateCheckpoints(num_checkpoints if self.checkpointing else 0, num_state_slots,
                                            checkpoint_bytes, self._checkpoint_gone, self.sessions.kept_checkpoint)
        self.host_checkpoints = (HostTier(host_checkpoints, self.tree.unref, self.sessions.kept_checkpoint)
                                 if self.checkpointing and host_checkpoints else None)
        if disk is not None and self.checkpointing and self.host_checkpoints is None:
            raise ValueError("the KV disk tier reads state checkpoints into the host tier's: it needs host_checkpoints")
        self.chains: dict[str, list[int]] = {}  # per request: the prefix nodes of its registered full blocks
        self.pending: dict[str, CheckpointCopy] = {}  # per request: the checkpoint its running chunk will save
        self.restores: dict[str, CheckpointCopy] = {}  # per admitted request: the checkpoint it resumes from

    def _kept_changed(self, node: int, kept: bool) -> None:
        """A session started or stopped keeping node: its free device blocks change queue (the host tier and
        the checkpoints ask when they choose a victim)."""
        for gi in range(len(self.groups)):
            block = self.pool.get_cached_block((node, gi))
            if block is not None:
                self.pool.requeue(block, kept)

    def expire_sessions(self) -> None:
        """Sessions idle past their time stop keeping their prefixes (once a step: O(1) when none lapses)."""
        self.sessions.expire()

    def _checkpoint_gone(self, node: int, row: int, still_valid: bool) -> None:
        """A checkpoint left its device row: the host tier, if any, keeps a still valid one (and its node's
        reference)."""
        self.windows.drop(node)
        host = self.host_checkpoints
        if not (still_valid and host is not None and host.demote((node, CHECKPOINT), row)):
            self.tree.unref(node)

    def _block_evicted(self, block: int, key: BlockKey) -> None:
        """The host tier, if any, keeps the block's contents (and its node's reference). A checkpoint whose hit
        reads the block's window can serve none once they are gone: it goes too; while the host tier holds them
        it stays (a hit promotes the window from there, and find_hit checks every window block is somewhere)."""
        if self.host is None or not self.host.demote(key, block):
            self.tree.unref(key[0])
        if self.host is not None and key in self.host:
            self.windows.forget_block(block)
            return
        for reader in self.windows.readers(block):
            self.checkpoints.evict(reader)

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

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The deepest prefix hit every group (and, where needed, a state checkpoint) can serve. It stops
        before the last token, so logits exist; a block-aligned prompt therefore recomputes its last block into
        a block of its own, and a shared block is never written. Nothing for a request that wants its prompt's
        logprobs (Request.skip_reading_prefix_cache): its blocks are still cached for others once written."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return PrefixHit(tuple([] for _ in self.groups), 0)
        keys = self._block_tokens(request, (request.num_tokens - 1) // self.block_size)
        return find_hit(self.tree.walk(keys), self.groups, self.pool, self.block_size,
                        self.checkpoints if self.checkpointing else None, self.host, self.host_checkpoints)

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
            # a hit's block in the free queue, or in the host tier (a device block to load it into), costs one
            taken = sum(1 for b in hit if b < NULL_BLOCK or (b != NULL_BLOCK and self.pool.ref_counts[b] == 0))
            total += new + taken - back
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
        return self._grow(request_id, [num_tokens] * len(self.groups), computed_blocks, num_computed, 0, ())

    def admit(self, request_id: str, num_tokens: int, first_chunk_end: int, chunk: int,
              hit: PrefixHit | None = None) -> bool:
        """Admission on the whole prompt: full-attention groups get blocks for all num_tokens now; a sliding
        group gets those of its first chunk, and only if the pool also has room for it to grow to the most it
        will hold (prefilling `chunk` tokens a step), so an admitted prompt does not stall between chunks. A hit
        with a checkpoint leaves the copy that restores it in restores[request_id], for the runner."""
        if self._uses_state and request_id not in self.state_slots and not self._free_slots:
            return False
        if hit is not None and hit.checkpoint < NULL_BLOCK and not self.checkpoints.num_free and not self.checkpoints:
            return False  # its checkpoint is in the host tier, and every device checkpoint slot is pending
        computed_blocks, num_computed = (hit.blocks, hit.num_tokens) if hit is not None else ((), 0)
        ends = [num_tokens if g.window is None else first_chunk_end for g in self.groups]
        room = sum(max(0, blocks_held(g.window, num_tokens, self.block_size, chunk) - self.blocks_for(first_chunk_end))
                   for g in self.groups if g.window is not None)
        if not self._grow(request_id, ends, computed_blocks, num_computed, room, hit.nodes if hit is not None else ()):
            return False
        if self._uses_state and request_id not in self.state_slots:
            self.state_slots[request_id] = self._free_slots.pop()
        if hit is not None and hit.num_tokens:
            self.chains[request_id] = list(hit.nodes)
            for node in hit.nodes:
                self.tree.ref(node)
            row = hit.checkpoint if hit.checkpoint >= 0 else self._promote_checkpoint(hit)
            if row >= 0:
                tails = self._tail_blocks(request_id, num_computed)
                self.restores[request_id] = CheckpointCopy(row, self.state_slots.get(request_id, -1),
                                                           num_computed, tails)
        return True

    def _promote_checkpoint(self, hit: PrefixHit) -> int:
        """The device row a hit's checkpoint in the host tier is loaded into (-1 for a hit that needs none):
        a slot taken like a pending checkpoint's (its least recently used owner demoted), registered for the
        hit's node, with its window blocks (promoted by now) as its readers."""
        host = self.host_checkpoints
        if hit.checkpoint == NULL_BLOCK or host is None:
            return -1
        node = hit.nodes[-1]
        row = self.checkpoints.get(node)
        if row is not None:  # (registered on the device since the hit was found)
            return row
        slot = host_slot(hit.checkpoint)
        assert slot is not None and host.lookup((node, CHECKPOINT)) == slot
        host.hold({slot})
        row = self.checkpoints.take()
        host.release()
        assert row is not None  # admit checked a slot can be had
        host.promote((node, CHECKPOINT), row)
        if self.checkpoints.register(node, row):
            self.tree.ref(node)
        self.windows.add(node, window_blocks(self.groups, self.pool, list(hit.nodes), hit.num_tokens,
                                             self.block_size))
        return row

    def _tail_blocks(self, request_id: str, position: int) -> tuple[int, ...]:
        """The request's block in each group whose page a checkpoint at position copies (-1: none)."""
        tails = (g.tail_block(position) for g in self.groups)
        return tuple(-1 if i is None else g.tables[request_id][i] for g, i in zip(self.groups, tails))

    def plan_checkpoint(self, request_id: str, position: int) -> CheckpointCopy | None:
        """A slot for the state the request's running chunk reaches at `position`, to be saved after it runs
        (and registered by cache_full_blocks once it has); None when every checkpoint slot is pending. The
        tail blocks are the compressed groups' partly filled blocks there, copied with the state."""
        held = self.pending.get(request_id)
        if held is not None:
            if held.position == position:
                return held
            self.checkpoints.release(held.checkpoint)
            del self.pending[request_id]
        slot = self.checkpoints.take()
        if slot is None:
            return None
        copy = CheckpointCopy(slot, self.state_slots.get(request_id, -1), position,
                              self._tail_blocks(request_id, position))
        self.pending[request_id] = copy
        return copy

    def _grow(self, request_id: str, ends: list[int], computed_blocks: GroupBlocks, num_computed: int,
              room: int, nodes: tuple[int, ...]) -> bool:
        """nodes: the hit's prefix nodes (the keys of the blocks it takes from the host tier)."""
        if self._need(request_id, ends, computed_blocks, num_computed) + room > self.pool.num_free:
            return False
        # Every group's hit leaves the free queue before any group allocates: otherwise one group's new blocks
        # could be another group's hit blocks, evicted and handed out while that group takes them as cached.
        for gi, g in enumerate(self.groups):
            hit = computed_blocks[gi] if computed_blocks else []
            if hit:
                table = g.tables.setdefault(request_id, [])
                assert not table, "a prefix hit only starts an empty table"
                self.pool.touch([b for b in hit if b >= 0])
                table.extend(hit)
                g.num_cached_block[request_id] = len(hit)
        if self.host is not None:  # the hit's blocks in the host tier get device blocks, loaded before the forward
            # (held meanwhile: allocating a block may evict, and demote, another, which must not drop one of them)
            self.host.hold({s for t in computed_blocks for b in t if (s := host_slot(b)) is not None})
            for gi, g in enumerate(self.groups):
                table = g.tables.get(request_id, [])
                per = g.tokens_per_block // self.block_size
                for i, b in enumerate(table):
                    slot = host_slot(b)
                    if slot is None:
                        continue
                    key = (nodes[(i + 1) * per - 1], gi)
                    table[i] = self.pool.allocate(1)[0]
                    self.host.promote(key, table[i])
                    if self.pool.cache_block(table[i], key):
                        self.tree.ref(key[0])
            self.host.release()
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
        """Register what num_computed_tokens has filled: the request's full blocks in every group and the
        checkpoint its chunk saved at that position. Call after the step ran."""
        if not self.enable_caching:
            return
        rid, size = request.request_id, self.block_size
        end = num_computed_tokens // size
        chain = self.chains.setdefault(rid, [])
        if end > len(chain):  # a step that fills a block (most decode steps fill none)
            keys = self._block_tokens(request, end)
            parent = chain[-1] if chain else ROOT
            for i in range(len(chain), end):
                parent = self.tree.extend(parent, keys[i])
                chain.append(parent)
        disk = self.disk
        if disk is not None:
            disk.digests(request, end)
        for gi, g in enumerate(self.groups):
            table = g.tables.get(rid)
            start = g.num_cached_block.get(rid, 0)
            stop = num_computed_tokens // g.tokens_per_block
            if table is None or stop <= start:
                continue
            per = g.tokens_per_block // size
            for i in range(start, stop):
                if table[i] != NULL_BLOCK:  # else a window passed it over: never held
                    node = chain[(i + 1) * per - 1]
                    if self.pool.cache_block(table[i], (node, gi)):
                        self.tree.ref(node)
                        if disk is not None:
                            disk.store(request, (i + 1) * per - 1, gi, table[i])
            g.num_cached_block[rid] = stop
        saved = self.pending.get(rid)
        if saved is not None and num_computed_tokens >= saved.position:
            del self.pending[rid]
            node = chain[saved.position // size - 1]
            if num_computed_tokens == saved.position and self.checkpoints.register(node, saved.checkpoint):
                self.tree.ref(node)
                self.windows.add(node, window_blocks(self.groups, self.pool, chain, saved.position, size))
            elif num_computed_tokens != saved.position:
                self.checkpoints.release(saved.checkpoint)
            if disk is not None and num_computed_tokens == saved.position:
                # Its row holds the state until a later step's copies: the runner copies it out before any (even
                # when the node had a checkpoint already and the row went back, as the disk may have lost that one).
                disk.store(request, saved.position // size - 1, CHECKPOINT, saved.checkpoint)

    def fetch_from_disk(self, request: Request, hit: PrefixHit) -> bool:
        """True while the request waits for its prefix from the disk tier: what the deepest hit the tiers together
        serve needs from disk (its blocks, and its checkpoint where hits need one) starts to be read now when
        that hit lies past `hit` (once in the request's life, and no more blocks than the host tier holds, so a
        fetch never evicts its own blocks: ladle.kv_cache.disk_hits). The scheduler passes it over meanwhile."""
        disk = self.disk
        if disk is None or request.skip_reading_prefix_cache:
            return False
        rid = request.request_id
        if disk.reading(rid):
            return True
        if rid in disk.fetched:
            return False
        host = self.host
        assert host is not None  # a disk tier comes with a host tier
        last = (request.num_tokens - 1) // self.block_size  # a hit stops before the last token
        nodes = self.tree.walk(self._block_tokens(request, last))
        disk.digests(request, last)

        def lookup(j: int, gi: int) -> int | None:
            return block_entry((nodes[j], gi), self.pool, host) if j < len(nodes) else None

        def checkpoint(j: int) -> int | None:
            return (checkpoint_entry(nodes[j], self.checkpoints, self.host_checkpoints) if j < len(nodes)
                    else None)

        reads = disk_reads(hit.num_tokens // self.block_size, last, self.groups, self.block_size, lookup,
                           checkpoint if self.checkpointing else None,
                           lambda j, group: disk.has(request, j, group), host.num_slots)
        if not reads:
            return False
        disk.read(request, reads)
        return True

    def poll_disk(self) -> None:
        """Blocks and checkpoints the disk tier has read and checked become host-tier entries (their pages go to
        the runner); their requests stop waiting."""
        if self.disk is None:
            return
        by_request: dict[str, list[DiskRead]] = {}
        for read in self.disk.finished():
            if read.pages is not None:
                by_request.setdefault(read.request.request_id, []).append(read)
        assert self.host is not None  # a disk tier comes with a host tier
        for reads in by_request.values():
            request = reads[0].request
            keys = self._block_tokens(request, 1 + max(r.index for r in reads))
            nodes, parent = [], ROOT
            for tokens in keys:  # the prefix's nodes, made where missing, each with a reference for us
                parent = self.tree.extend(parent, tokens)
                nodes.append(parent)
            # The hit's blocks the host tier holds already (disk_hits left room for them) stay while the reads fill
            # other slots, and become the most recently used: least recently used, they would be the first dropped.
            self.host.hold({s for node in nodes for gi in range(len(self.groups))
                            if (s := self.host.touch((node, gi))) is not None})
            for read in reads:
                key = (nodes[read.index], read.group)
                if read.group == CHECKPOINT:
                    tier, fills, held = self.host_checkpoints, self.disk.checkpoint_fills, self.checkpoints.has(key[0])
                else:
                    tier, fills, held = self.host, self.disk.fills, self.pool.get_cached_block(key) is not None
                assert tier is not None  # (a checkpoint is read only where the host tier keeps checkpoints)
                if held or key in tier:
                    continue
                slot = tier.fill(key)
                if slot is not None:
                    assert read.pages is not None  # (only the reads that passed their checks are here)
                    self.tree.ref(key[0])  # the entry's
                    fills.append((slot, read.pages))
                    self.disk.num_loaded += 1
                    self.disk.num_loaded_checkpoints += read.group == CHECKPOINT
            self.host.release()
            for node in nodes:
                self.tree.unref(node)

    def free(self, request_id: str, session: str | None = None) -> None:
        """Drop the request's references (its state slot and pending checkpoint too); its registered blocks
        and checkpoints stay cached until evicted. session: the session the request ended a turn of, which now
        keeps the request's prefix (not given for a preemption: the request comes back)."""
        if session is not None and self.enable_caching:
            chain = self.chains.get(request_id, [])
            host = self.host_checkpoints
            deepest = next((n for n in reversed(chain) if self.checkpoints.has(n)
                            or (host is not None and (n, CHECKPOINT) in host)), -1) if self.checkpointing else -1
            self.sessions.record(session, chain, deepest)
        slot = self.state_slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            self.checkpoints.release(pending.checkpoint)
        self.restores.pop(request_id, None)
        if self.disk is not None:
            self.disk.forget(request_id)
        for g in self.groups:
            self.pool.release([b for b in g.tables.pop(request_id, []) if b != NULL_BLOCK])
            g.num_cached_block.pop(request_id, None)
        for node in self.chains.pop(request_id, ()):
            self.tree.unref(node)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and checkpoint, the disk tier's entries too; refused (False) while any block
        is in use."""
        if any(self.pool.ref_counts):
            return False
        self.sessions.clear()
        self.checkpoints.clear()
        if self.host_checkpoints is not None:
            self.host_checkpoints.clear()
        host, self.host = self.host, None  # the pool's evictions below are not demotions
        self.pool.reset_prefix_cache()
        self.host = host
        if host is not None:
            host.clear()
        if self.disk is not None:
            self.disk.clear()
        return True
