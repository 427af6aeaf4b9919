"""The device's expert slots, shared by every tiered MoE layer: which (layer, expert) each slot holds, least
recently used first, and the counters of what the cache did. Slots an unfinished layer still needs are pinned,
so a fetch never evicts an expert the running layer is about to compute."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class Backing(Protocol):
    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int: ...


@dataclass
class ExpertCacheStats:
    """Counted by the cache; the engine reads them into llm.stats and /metrics."""
    hits: int = 0
    misses: int = 0  # fetched, or computed in place
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0
    computed_in_place: int = 0  # misses computed where the expert lives (moe_strategy cpu or hybrid)


class ExpertCache(nn.Module):
    """num_slots slots, each one expert's tensors (name -> shape, dtype): registered buffers, so the model's
    weights count them and the loader allocates them on the device."""

    def __init__(self, num_slots: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        self.num_slots = num_slots
        self.names = tuple(shapes)
        for name, (shape, dtype) in shapes.items():
            self.register_buffer(f"slots_{name}", torch.empty((num_slots, *shape), dtype=dtype))
        self.keep_dtypes = tuple(f"slots_{name}" for name in shapes)  # the loader allocates them as declared
        self.stats = ExpertCacheStats()
        self._where: dict[tuple[int, int], int] = {}
        self._holds: list[tuple[int, int] | None] = [None] * num_slots
        self._order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # LRU first
        self._pinned: set[int] = set()

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"slots_{name}") for name in self.names}

    def lookup(self, layer: int, expert: int) -> int | None:
        return self._where.get((layer, expert))

    def free_slots(self) -> int:
        """Slots a fetch may take now: those not pinned."""
        return self.num_slots - len(self._pinned)

    def acquire(self, layer: int, expert: int, backing: Backing) -> int:
        """The slot holding the expert, fetched into the least recently used unpinned slot on a miss; pinned
        until release()."""
        slot = self._where.get((layer, expert))
        if slot is not None:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            slot = self._victim()
            start = time.perf_counter()
            tensors = self.slot_tensors()
            self.stats.bytes_fetched += backing.read_into(expert, {n: t[slot] for n, t in tensors.items()})
            self.stats.fetch_seconds += time.perf_counter() - start
            self._where[(layer, expert)] = slot
            self._holds[slot] = (layer, expert)
        self._order.move_to_end(slot)
        self._pinned.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self._pinned.discard(slot)

    def _victim(self) -> int:
        for slot in self._order:
            if slot not in self._pinned:
                held = self._holds[slot]
                if held is not None:
                    del self._where[held]
                    self._holds[slot] = None
                return slot
        raise RuntimeError(f"every one of the {self.num_slots} expert slots is pinned by the running layer")

    def clear(self) -> None:
        """Forget every slot's expert (the bytes stay until written over)."""
        self._where.clear()
        self._holds = [None] * self.num_slots
        self._pinned.clear()
