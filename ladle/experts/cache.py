"""The device's expert slots, shared by every tiered MoE layer: which (layer, expert) each slot holds, and the
counters of what the cache did. A slot being fetched or about to be computed is pinned, so no fetch evicts an
expert the running layer still needs.

Eviction is least recently used while the slots hold at least a decode step's experts (layers x top-k): then
recency predicts reuse. With fewer, LRU evicts every expert before its layer comes round again (qwen3-moe-512 at
a 12.5% cache: no decode hits), so eviction looks ahead instead: layers run in a fixed cycle, and the victim is
a slot whose layer runs furthest ahead (the running layer's finished experts first, then the previous layer's,
...), least recently used among them, which keeps the coming layers' experts (22% hits there). Measured both
ways: at 25% and 50% looking ahead lost hits (0.38 / 0.59 against LRU's 0.42 / 0.67), as it drops a layer's
older experts that the next token may route to again.

Fetches can run ahead on one worker thread (prefetch): the running layer's misses while its first experts
compute, and during a prefill the next layer's experts too, through the slots the running layer does not need
(double buffering, as the field report's engine streams whole layers). All bookkeeping stays on the calling
thread; the worker only copies bytes into the slot it was given."""
from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol, overload

import torch
from torch import nn

from ladle.quantization.layer_interfaces import KeepsDtypes


class Backing(Protocol):
    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int: ...


@dataclass
class ExpertCacheStats:
    """Counted by the cache; the engine reads them into llm.stats and /metrics."""
    hits: int = 0
    misses: int = 0  # fetched, or computed in place
    bytes_fetched: int = 0
    fetch_seconds: float = 0.0  # reading experts into slots, on whichever thread read them
    wait_seconds: float = 0.0  # of it, what a layer spent waiting for its experts to arrive
    computed_in_place: int = 0  # misses computed where the expert lives (moe_strategy cpu or hybrid)
    prefetched: int = 0  # fetches started ahead of the expert's turn


Key = tuple[int, int]  # (layer, expert)


class ExpertCache(nn.Module, KeepsDtypes):
    """num_slots slots, each one expert's tensors (name -> shape, dtype): registered buffers, so the model's
    weights count them and the loader allocates them on the device."""

    def __init__(self, num_slots: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 num_layers: int = 1, top_k: int = 1) -> None:
        super().__init__()
        self.num_slots, self.num_layers = num_slots, num_layers
        self.look_ahead = num_slots < num_layers * top_k
        self.names = tuple(shapes)
        for name, (shape, dtype) in shapes.items():
            self.register_buffer(f"slots_{name}", torch.empty((num_slots, *shape), dtype=dtype))
        self.keep_dtypes = tuple(f"slots_{name}" for name in shapes)  # the loader allocates them as declared
        self.stats = ExpertCacheStats()
        self._where: dict[Key, int] = {}
        self._holds: list[Key | None] = [None] * num_slots
        # The slots of each layer's experts (None: empty ones), and all of them, least recently used first.
        self._by_layer: dict[int | None, OrderedDict[int, None]] = {None: OrderedDict.fromkeys(range(num_slots))}
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self._pinned: set[int] = set()
        self._pending: dict[Key, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.prefetch_enabled = False  # on: fetches start ahead on the worker (the moe_prefetch setting)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"slots_{name}") for name in self.names}

    def coming(self, layer: int, expert: int) -> bool:
        """Held or being fetched."""
        return (layer, expert) in self._where

    def acquire(self, layer: int, expert: int, backing: Backing, keep: frozenset[Key] = frozenset()) -> int:
        """The slot holding the expert, fetched on a miss into the slot _victim picks, one holding none of `keep`
        (the running layer's other experts) where there is one (or waited for, if a prefetch has it coming);
        pinned until release()."""
        key = (layer, expert)
        slot = self._where.get(key)
        if key in self._pending:
            self.stats.misses += 1
            start = time.perf_counter()
            self._settle(key)
            self.stats.wait_seconds += time.perf_counter() - start
        elif slot is not None:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            victim = self._victim(keep, layer, must=False)
            slot = self._take(key, victim if victim is not None else self._victim(frozenset(), layer, must=True))
            try:
                nbytes, seconds = _read(backing, expert, self._views(slot))
            except BaseException:
                self._forget(key)
                raise
            self._count(nbytes, seconds)
            self.stats.wait_seconds += seconds
        slot = self._where[key]
        self._by_layer[layer].move_to_end(slot)
        self._order.move_to_end(slot)
        self._pinned.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self._pinned.discard(slot)

    def prefetch(self, layer: int, expert: int, backing: Backing, keep: frozenset[Key]) -> bool:
        """Start fetching the expert on the worker into a slot holding none of `keep` (the experts the running
        layer still needs); False when no such slot is free now."""
        key = (layer, expert)
        if key in self._where:
            return True
        if not self.prefetch_enabled:
            return False
        victim = self._victim(keep, layer, must=False)
        if victim is None:
            return False
        slot = self._take(key, victim)
        self._pinned.add(slot)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ladle-expert-fetch")
        self._pending[key] = self._pool.submit(_read, backing, expert, self._views(slot))
        self.stats.prefetched += 1
        return True

    def settle_layer(self, layer: int, needed: set[int]) -> None:
        """Wait for the layer's prefetches it turned out not to need, and unpin their slots (they stay cached)."""
        for key in [k for k in self._pending if k[0] == layer and k[1] not in needed]:
            self._settle(key)
            self._pinned.discard(self._where[key])

    def _settle(self, key: Key) -> None:
        try:
            nbytes, seconds = self._pending.pop(key).result()
        except BaseException:
            self._forget(key)  # its slot holds part of something else: no later step may take it for the expert
            raise
        self._count(nbytes, seconds)

    def _forget(self, key: Key) -> None:
        slot = self._where.pop(key)
        self._move(slot, None)
        self._pinned.discard(slot)

    def _count(self, nbytes: int, seconds: float) -> None:
        self.stats.bytes_fetched += nbytes
        self.stats.fetch_seconds += seconds

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        return {n: t[slot] for n, t in self.slot_tensors().items()}

    def _take(self, key: Key, slot: int) -> int:
        held = self._holds[slot]
        if held is not None:
            del self._where[held]
        self._where[key] = slot
        self._move(slot, key)
        return slot

    def _move(self, slot: int, key: Key | None) -> None:
        """The slot now holds key (None: nothing), the most recently used of its layer's."""
        held = self._holds[slot]
        self._by_layer[None if held is None else held[0]].pop(slot)
        self._holds[slot] = key
        self._by_layer.setdefault(None if key is None else key[0], OrderedDict())[slot] = None
        self._order.move_to_end(slot)

    @overload
    def _victim(self, keep: frozenset[Key], layer: int, must: Literal[True]) -> int: ...
    @overload
    def _victim(self, keep: frozenset[Key], layer: int, must: bool) -> int | None: ...
    def _victim(self, keep: frozenset[Key], layer: int, must: bool) -> int | None:
        """For the running layer: an empty slot, else the least recently used (or, looking ahead, one whose layer
        runs furthest ahead, least recently used among those), never pinned nor holding one of keep; None if there
        is none, unless `must`: a fetch for the expert about to run always finds one, as prefetches run in the
        order experts do and stop at the first that finds no slot."""
        if self.look_ahead:
            ahead = sorted((held for held in self._by_layer if held is not None),
                           key=lambda held: (held - layer - 1) % self.num_layers, reverse=True)
            groups = [self._by_layer[None], *(self._by_layer[held] for held in ahead)]
        else:
            groups = [self._by_layer[None], self._order]
        for group in groups:
            for slot in group:
                if slot not in self._pinned and self._holds[slot] not in keep:
                    return slot
        if not must:
            return None
        raise RuntimeError(f"every one of the {self.num_slots} expert slots is pinned by the running layer")

    def unpin_all(self) -> None:
        """After a failed forward: no fetch left running, no slot left pinned (a failed fetch's expert forgotten)."""
        for key in list(self._pending):
            try:
                self._settle(key)
            except Exception:  # noqa: BLE001 - the forward's own error is the one raised
                pass
        self._pinned.clear()

    def clear(self) -> None:
        """Forget every slot's expert (the bytes stay until written over)."""
        self.unpin_all()
        self._where.clear()
        self._holds = [None] * self.num_slots
        self._by_layer = {None: OrderedDict.fromkeys(range(self.num_slots))}
        self._order = OrderedDict.fromkeys(range(self.num_slots))
        self._pinned.clear()


def _read(backing: Backing, expert: int, dest: dict[str, torch.Tensor]) -> tuple[int, float]:
    start = time.perf_counter()
    nbytes = backing.read_into(expert, dest)
    return nbytes, time.perf_counter() - start
