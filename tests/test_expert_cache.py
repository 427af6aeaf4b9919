"""The expert slot cache (ladle.experts.cache) on its own: LRU eviction that never takes a pinned slot and
prefers one the running layer does not still need, prefetches on the worker thread that stop where no such slot
is free, their accounting, and a failed forward that leaves nothing pinned."""
from __future__ import annotations

import pytest
import torch

from ladle.experts.cache import ExpertCache
from ladle.experts.compute import each_expert, expert_mlp
from ladle.experts.tiered import MissPolicy, TieredExperts

SHAPES = {"w13": ((4, 3), torch.float32), "w2": ((3, 2), torch.float32)}


class Backing:
    """Expert e's tensors filled with e; `fail_on` makes that expert's read raise once."""

    def __init__(self, num_experts: int = 8, fail_on: int | None = None) -> None:
        self.reads: list[int] = []
        self.fail_on = fail_on
        self.tensors = {n: torch.stack([torch.full(s, float(e)) for e in range(num_experts)])
                        for n, (s, _) in SHAPES.items()}
        self.nbytes = sum(t.numel() * 4 for t in self.tensors.values())

    def read_into(self, expert: int, dest: dict[str, torch.Tensor]) -> int:
        if expert == self.fail_on:
            self.fail_on = None
            raise OSError("disk gone")
        self.reads.append(expert)
        for name, t in dest.items():
            t.copy_(self.tensors[name][expert])
        return sum(t.numel() * 4 for t in dest.values())

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        return {n: t[expert] for n, t in self.tensors.items()}


def _cache(slots: int, layers: int = 1, top_k: int = 1) -> ExpertCache:
    cache = ExpertCache(slots, SHAPES, layers, top_k)
    for t in cache.slot_tensors().values():
        t.zero_()
    return cache


def _use(cache: ExpertCache, backing: Backing, expert: int, layer: int = 0, keep=frozenset()) -> int:
    slot = cache.acquire(layer, expert, backing, keep)
    assert cache.slot_tensors()["w13"][slot].eq(expert).all()  # the slot holds what was asked for
    cache.release(slot)
    return slot


def test_least_recently_used_goes_first_and_hits_are_counted():
    cache, backing = _cache(2), Backing()
    _use(cache, backing, 1), _use(cache, backing, 2), _use(cache, backing, 1)  # 2 is now the least recent
    _use(cache, backing, 3)
    assert backing.reads == [1, 2, 3] and cache.stats.hits == 1 and cache.stats.misses == 3
    _use(cache, backing, 1)  # still held
    _use(cache, backing, 2)  # was evicted by 3
    assert backing.reads == [1, 2, 3, 2] and cache.stats.bytes_fetched == 4 * backing.nbytes // 8


def test_with_fewer_slots_than_a_steps_experts_eviction_keeps_the_layers_that_come_soonest():
    """Three layers, two slots, a step routing each layer to one expert: at layer 2 the slot of layer 1 (next
    needed after layer 0's) goes, where LRU would drop layer 0's, needed first. The running layer's finished
    experts go before any other layer's. With slots for a whole step's experts, eviction is LRU."""
    lru = _cache(3, layers=3)
    assert not lru.look_ahead
    for layer, expert in ((0, 1), (1, 2), (2, 3), (0, 4)):  # layer 0's expert 1 is the least recently used
        _use(lru, Backing(), expert, layer=layer)
    assert not lru.coming(0, 1) and lru.coming(1, 2)
    cache, backing = _cache(2, layers=3), Backing()
    assert cache.look_ahead
    _use(cache, backing, 1, layer=0), _use(cache, backing, 2, layer=1), _use(cache, backing, 3, layer=2)
    assert cache.coming(0, 1) and not cache.coming(1, 2)
    _use(cache, backing, 1, layer=0)  # the next step's layer 0: a hit
    assert cache.stats.hits == 1
    _use(cache, backing, 4, layer=0)  # layer 0 again: its own finished expert 1 goes, layer 2's is kept
    assert cache.coming(2, 3) and not cache.coming(0, 1)


def test_a_pinned_slot_is_never_taken_and_the_layers_other_experts_are_kept_if_possible():
    cache, backing = _cache(3), Backing()
    held = cache.acquire(0, 1, backing)  # pinned: computing
    _use(cache, backing, 2), _use(cache, backing, 3)
    _use(cache, backing, 4, keep=frozenset({(0, 2)}))  # the layer still needs 2: 3 goes
    assert cache.coming(0, 1) and cache.coming(0, 2) and not cache.coming(0, 3)
    cache.acquire(0, 2, backing), cache.acquire(0, 4, backing)
    with pytest.raises(RuntimeError, match="every one of the 3 expert slots is pinned"):
        cache.acquire(0, 5, backing)
    cache.release(held)
    assert cache.acquire(0, 5, backing) == held


def test_prefetches_stop_where_no_slot_is_free_and_count_when_their_expert_runs():
    cache, backing = _cache(3), Backing()
    cache.prefetch_enabled = True
    keep = frozenset({(0, 1), (0, 2), (0, 3), (0, 4)})
    assert all(cache.prefetch(0, e, backing, keep) for e in (1, 2, 3))
    assert not cache.prefetch(0, 4, backing, keep)  # every slot holds an expert the layer needs
    assert cache.stats.prefetched == 3 and cache.stats.misses == 0
    _use(cache, backing, 1)
    assert cache.stats.misses == 1 and cache.stats.bytes_fetched > 0
    assert cache.prefetch(0, 4, backing, keep - {(0, 1)})  # 1 ran: its slot takes 4
    _use(cache, backing, 2)
    assert cache.prefetch(1, 6, backing, frozenset({(0, 3), (0, 4)}))  # the next layer's, predicted
    cache.settle_layer(1, needed=set())  # that layer did not route to 6: it stays cached, unpinned
    assert cache.coming(1, 6)
    _use(cache, backing, 3), _use(cache, backing, 4)
    assert cache.stats.misses == 4 and sorted(backing.reads) == [1, 2, 3, 4, 6]
    assert cache.acquire(0, 7, backing) is not None  # 6's slot was unpinned by settle_layer


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_failed_fetch_leaves_no_slot_pinned_and_no_expert_half_read(prefetch):
    cache, backing = _cache(2), Backing(fail_on=3)
    cache.prefetch_enabled = prefetch
    layer = TieredExperts(0, backing, cache, MissPolicy("offload"), 8)
    x = torch.randn(4, 3)
    ids = torch.tensor([[1, 3], [2, 3], [1, 2], [3, 1]])
    weights = torch.rand(4, 2)

    def stacks(dtype, tensors):
        return tensors["w13"], tensors["w2"]

    with pytest.raises(OSError, match="disk gone"):
        layer.forward(x, weights, ids, None, stacks)
    assert not cache.coming(0, 3)  # its slot's bytes are not expert 3's
    out = layer.forward(x, weights, ids, None, stacks)  # nothing left pinned: the next step runs
    want = each_expert(x, weights, ids, 8, lambda rows, e: expert_mlp(rows, backing.tensors["w13"],
                                                                       backing.tensors["w2"], e, None))
    assert torch.equal(out, want)
