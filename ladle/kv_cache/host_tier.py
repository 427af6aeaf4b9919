"""The prefix cache's host tier: cached blocks the device pool evicts are demoted to host slots instead of being
dropped, and a prefix hit on one is promoted back into a fresh device block.

Only ids live here, as in the pool; the runner holds the host tensors and does the copies, which every step's
StateUpdate carries (ladle.runner.payload): the fills from the disk tier first (ladle.kv_cache.disk_tier), then the
saves (device block -> host slot, before the forward that may write the block for its new owner), then the loads
(host slot -> device block, before any query reads it).

An entry is keyed like a cached device block (its prefix node and KV cache group, ladle.kv_cache.block_pool), so a
host hit is exact for the same reason a device hit is, and it holds a reference on its node while it lives.
Caching is inclusive: a promoted block keeps its host copy, so evicting it again copies nothing. Slots are
reused least recently used first, an entry whose node a live session keeps (ladle.kv_cache.session_retention)
only when no other is left; every page size of a layout is equal (ladle.kv_cache.specs), so one slot
holds a block of any group.

The state checkpoints of a model with per-request state tier the same way, in a HostTier of their own keyed
(node, CHECKPOINT): one the device's checkpoint slots evict for room (ladle.kv_cache.state_checkpoints) is demoted
from its row, and a hit on it takes a row again, loaded before the step's restores. A checkpoint is exact for
its node whichever request wrote it; one that can no longer serve (a window block it reads was dropped) is never
demoted.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ladle.kv_cache.block_pool import BlockKey

KVTransfer = tuple[int, int]  # (from, to): a device block (or checkpoint row) and a host slot, or the reverse
CHECKPOINT = -1  # the group of a state checkpoint's key


class HostTier:
    def __init__(self, num_slots: int, on_drop: Callable[[int], None],
                 kept: Callable[[int], bool] | None = None) -> None:
        """on_drop(node): an entry left the tier (its node loses the reference the entry held); kept(node): a
        session keeps the node, so its entry is dropped after every other."""
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.on_drop = on_drop
        self.kept = kept
        self.entries: OrderedDict[BlockKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.saves: list[KVTransfer] = []  # (device block, host slot), for the runner before the next forward
        self.loads: list[KVTransfer] = []  # (host slot, device block), after the saves
        self.held: set[int] = set()  # slots an admission is about to promote: not dropped meanwhile
        self.num_demoted = self.num_promoted = self.num_dropped = self.num_filled = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.entries

    def lookup(self, key: BlockKey) -> int | None:
        return self.entries.get(key)

    def touch(self, key: BlockKey) -> int | None:
        """lookup(), and the entry (if any) becomes the most recently used."""
        slot = self.entries.get(key)
        if slot is not None:
            self.entries.move_to_end(key)
        return slot

    def demote(self, key: BlockKey, block: int) -> bool:
        """The pool evicts block, cached under key: keep its contents. True when a new entry took the block's
        reference on the node; False when the tier already held the key, or every slot is being loaded from
        this step (the caller drops its reference)."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self.entries[key] = slot
        self.saves.append((block, slot))
        self.num_demoted += 1
        return True

    def _take_slot(self, for_fill: bool = False) -> int | None:
        """A free slot, else the least recently used entry's; but not one a load of this step still reads (the
        loads run after the saves and fills) nor one an admission holds, and for a fill not one a save of this
        step writes (the fills run first). A slot written twice in one step ends with the later write, as it
        should. None when every slot is kept."""
        if self._free:
            return self._free.pop()
        kept = {s for s, _ in self.loads} | self.held
        if for_fill:
            kept |= {s for _, s in self.saves}
        session = self.kept
        old = next((k for k, s in self.entries.items() if s not in kept and (session is None or not session(k[0]))),
                   None)
        if old is None and session is not None:
            old = next((k for k, s in self.entries.items() if s not in kept), None)
        if old is None:
            return None
        slot = self.entries.pop(old)
        self.num_dropped += 1
        self.on_drop(old[0])
        return slot

    def fill(self, key: BlockKey) -> int | None:
        """A slot for key's block, read from the disk tier: the runner writes it (fills run before the saves),
        and the entry takes the caller's reference on key's node. None when the tier holds key already or
        every slot is kept (the caller drops its reference)."""
        if key in self.entries:
            return None
        slot = self._take_slot(for_fill=True)
        if slot is None:
            return None
        self.entries[key] = slot
        self.num_filled += 1
        return slot

    def hold(self, slots: set[int]) -> None:
        """Keep these slots' entries until release(): an admission's hit promotes them one block at a time, and
        the device blocks it allocates meanwhile may evict (and demote) others."""
        self.held = slots

    def release(self) -> None:
        self.held = set()

    def promote(self, key: BlockKey, block: int) -> None:
        """A hit on key is served from device block `block`, filled from the entry's slot before the forward."""
        slot = self.entries[key]
        self.entries.move_to_end(key)
        self.loads.append((slot, block))
        self.num_promoted += 1

    def take_transfers(self) -> tuple[list[KVTransfer], list[KVTransfer]]:
        """The copies owed to the runner since the last call: (saves, loads)."""
        saves, loads, self.saves, self.loads = self.saves, self.loads, [], []
        return saves, loads

    def clear(self) -> None:
        for key in list(self.entries):
            self.on_drop(key[0])
        self.entries.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.saves, self.loads = [], []
