"""The host tier's state checkpoints (ladle.kv_cache.state_checkpoints): a registered checkpoint the device's
checkpoint slots evict to make room (least recently used) is demoted to a host slot instead of dropped, and a
prefix hit on it takes a device checkpoint slot again, filled from the host slot before the step that restores
the request from it. So a model with per-request state (Gated DeltaNet, DeepSeek-V4's compressors) keeps its
returning sessions' hits as a model of full-attention layers keeps its blocks (ladle.kv_cache.host_tier).

Only ids live here; the runner holds the host copies (ladle.runner.host_kv_cache) and does the copies each step's
StateUpdate carries: the saves (device checkpoint row -> host slot) before the loads (host slot -> device row),
both before the step's restores. An entry holds a reference on its prefix node while it lives, as a device
checkpoint does; a checkpoint is exact for its node whichever request wrote it, so a node already held needs no
second copy. A checkpoint that can no longer serve (a window block it reads was dropped) is never demoted.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

CheckpointTransfer = tuple[int, int]  # (device checkpoint row, host slot) or (host slot, device checkpoint row)


class HostCheckpoints:
    def __init__(self, num_slots: int, on_drop: Callable[[int], None]) -> None:
        """on_drop(node): an entry left the tier (its node loses the reference the entry held)."""
        if num_slots < 1:
            raise ValueError(f"a host checkpoint tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.on_drop = on_drop
        self.entries: OrderedDict[int, int] = OrderedDict()  # node -> host slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.saves: list[CheckpointTransfer] = []
        self.loads: list[CheckpointTransfer] = []
        self.held: set[int] = set()  # a slot a promotion is about to read: not dropped meanwhile
        self.num_demoted = self.num_promoted = self.num_dropped = 0

    def __contains__(self, node: int) -> bool:
        return node in self.entries

    def lookup(self, node: int) -> int | None:
        return self.entries.get(node)

    def demote(self, node: int, row: int) -> bool:
        """The device evicts node's checkpoint from `row`: keep it. True when a new entry took the checkpoint's
        reference on the node; False when the tier holds node already, or every slot is kept this step (the
        caller drops its reference)."""
        if node in self.entries:
            self.entries.move_to_end(node)
            return False
        if self._free:
            slot = self._free.pop()
        else:
            kept = {s for s, _ in self.loads} | self.held
            old = next((n for n, s in self.entries.items() if s not in kept), None)
            if old is None:
                return False
            slot = self.entries.pop(old)
            self.num_dropped += 1
            self.on_drop(old)
        self.entries[node] = slot
        self.saves.append((row, slot))
        self.num_demoted += 1
        return True

    def promote(self, node: int, row: int) -> None:
        """A hit on node resumes from device checkpoint row `row`, filled from the entry's slot first."""
        slot = self.entries[node]
        self.entries.move_to_end(node)
        self.loads.append((slot, row))
        self.num_promoted += 1

    def take_transfers(self) -> tuple[list[CheckpointTransfer], list[CheckpointTransfer]]:
        saves, loads, self.saves, self.loads = self.saves, self.loads, [], []
        return saves, loads

    def clear(self) -> None:
        for node in list(self.entries):
            self.on_drop(node)
        self.entries.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.saves, self.loads = [], []
