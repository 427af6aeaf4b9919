"""A seeded random walk over the scheduler and the KV manager, one per cache-spec kind, with the bookkeeping
checked after every step: each block's ref count equals the table entries naming it, only registered blocks are
shared, free plus held blocks are the pool, no block sits in two groups, and state slots are unique and held
exactly by the admitted requests, and every state checkpoint slot is free, pending for one running request, or
registered under a live prefix node.

The walk adds requests (many share prefixes, so prefix hits happen where caching is on), aborts some, steps
with the scheduler's own update_from_output, preempts at random (and naturally, on a small pool) and lets
sliding windows give blocks back."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ladle.startup.engine_config import EngineConfig
from ladle.engine.scheduler import Scheduler
from ladle.kv_cache.specs import paged_group
from ladle.kv_cache.manager import NULL_BLOCK, KVCacheManager
from ladle.request import Request, RequestStatus
from ladle.runner.model_runner import SampledToken
from ladle.sampling_params import SamplingParams

BLOCK = 4
BLOCKS = 48
SLOTS = 6
CHECKPOINTS = 5  # few, so the walk evicts them
# kind: (paged groups, state slots, prefix caching)
KINDS = {
    "full": ((paged_group(),), 0, True),
    "sliding": ((paged_group(), paged_group(8)), 0, True),
    "state": ((paged_group(),), SLOTS, False),
    "compressed": ((paged_group(8), paged_group(None, (4, 1))), 0, False),
    "state_cached": ((paged_group(),), SLOTS, True),  # Qwen3.5's shape
    "compressed_cached": ((paged_group(8), paged_group(None, (4, 1)), paged_group(None, (2, 2))), SLOTS, True),
}


def check_invariants(sched: Scheduler, num_slots: int, seen: Counter[str]) -> int:
    """Asserts the bookkeeping holds; returns the table entries a sliding window has given back."""
    kv, pool = sched.kv, sched.kv.pool
    given_back = 0
    refs: Counter[int] = Counter()
    owner: dict[int, int] = {}
    for gi, tables in enumerate(kv.tables):
        for table in tables.values():
            for b in table:
                if b == NULL_BLOCK:
                    given_back += 1
                    continue
                refs[b] += 1
                assert owner.setdefault(b, gi) == gi, f"block {b} is in groups {owner[b]} and {gi}"
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == refs[b], f"block {b}: ref count {pool.ref_counts[b]}, {refs[b]} table entries"
        # Only a registered (full, written, never rewritten) block may be shared: a shared block that is not
        # registered was handed out again while a request still read it as cached.
        assert refs[b] <= 1 or pool.block_keys[b] is not None, f"block {b} is shared but not a cached block"
        assert (b in pool.free_queue) == (refs[b] == 0), f"block {b} free-queue membership disagrees with its refs"
    held = sum(1 for b in range(pool.num_blocks) if refs[b])
    assert held + pool.num_free == pool.num_blocks
    admitted = {r.request_id for r in sched.running}
    for tables in kv.tables:
        assert set(tables) <= admitted, "a request that is not running holds a block table"
    if num_slots:
        slots = list(kv.state_slots.values())
        assert len(set(slots)) == len(slots), f"state slots held twice: {slots}"
        assert set(kv.state_slots) == admitted
        assert sorted(slots + kv._free_slots) == list(range(num_slots))
    else:
        assert not kv.state_slots
    ck = kv.checkpoints
    registered = list(ck._by_node.values())
    pending = [c.checkpoint for c in kv.pending.values()]
    assert set(kv.pending) <= admitted, "a request that is not running holds a pending checkpoint"
    assert sorted(registered + pending + ck._free) == list(range(num_slots, num_slots + ck.num_checkpoints))
    assert all(kv.tree.refs(node) > 0 for node in ck._by_node), "a checkpoint under a dead prefix node"
    assert set(kv.windows.by_node) == set(ck._by_node), "a checkpoint without its window list, or the reverse"
    for node, blocks in kv.windows.by_node.items():  # a live checkpoint's window is still cached
        assert all(pool.block_keys[b] is not None for b in blocks), "a checkpoint outlived a window block"
    seen["window_blocks"] += sum(map(len, kv.windows.by_node.values()))
    for key in pool.cached_blocks:
        assert kv.tree.refs(key[0]) > 0, "a cached block under a dead prefix node"
    return given_back


def walk(kind: str, seed: int, num_ops: int = 400) -> Counter[str]:
    groups, num_slots, caching = KINDS[kind]
    cfg = EngineConfig(model="m", tokenizer="m", device=torch.device("cpu"), dtype=torch.float32,
                       max_model_len=96, max_num_batched_tokens=24, max_prefill_length=16, max_num_seqs=SLOTS,
                       block_size=BLOCK, num_kv_blocks=BLOCKS, seed=0, state_checkpoint_interval=8)
    kv = KVCacheManager(BLOCKS, BLOCK, enable_caching=caching, groups=groups, num_state_slots=num_slots,
                        num_checkpoints=CHECKPOINTS if caching else 0)
    sched = Scheduler(cfg, kv)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    seen: Counter[str] = Counter()
    for op in range(num_ops):
        roll = rng.random()
        if roll < 0.25:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 31)] + [rng.randrange(1, 50) for _ in range(20)][
                : rng.randrange(0, 20)]
            max_tokens = rng.randrange(1, 12)
            params = SamplingParams(max_tokens=max_tokens)
            sched.add(Request(f"r{op}", prompt, params, max_tokens, frozenset({3})))  # token 3 stops
            seen["add"] += 1
        elif roll < 0.32 and sched.requests:
            sched.finish(sched.requests[rng.choice(sorted(sched.requests))], RequestStatus.FINISHED_ABORTED)
            seen["abort"] += 1
        elif roll < 0.37 and sched.running:
            sched._preempt(rng.choice(sched.running))
            seen["preempt"] += 1
        elif sched.has_unfinished():
            out = sched.schedule()
            assert out.scheduled, "the scheduler made no progress"
            seen["preempted_by_scheduler"] += len(out.preempted_ids)
            seen["prefix_hit_tokens"] += out.prefix_cache_hits
            seen["checkpoint_saves"] += sum(s.checkpoint is not None for s in out.scheduled)
            sampled = {s.request.request_id: SampledToken(rng.randrange(1, 50), None)
                       for s in out.scheduled if s.samples}
            finished = [o for o in sched.update_from_output(out, sampled) if o.finish_reason is not None]
            seen["finished"] += len(finished)
            seen["step"] += 1
        seen["given_back"] += check_invariants(sched, num_slots, seen)
    while sched.has_unfinished():  # drain: everything finishes and every block comes back
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: SampledToken(7, None)
                                       for s in out.scheduled if s.samples})
        check_invariants(sched, num_slots, seen)
    assert kv.num_free_blocks == BLOCKS and not kv.state_slots and not kv.pending and not kv.chains
    seen["checkpoints_evicted"] = kv.checkpoints.num_evicted
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_random_walk_keeps_the_kv_bookkeeping(kind, seed):
    seen = walk(kind, seed)
    # The walk exercised what it claims to, so a pass means something.
    assert seen["add"] > 50 and seen["abort"] > 5 and seen["preempt"] > 5 and seen["finished"] > 20, seen
    groups, _, caching = KINDS[kind]
    if caching:
        assert seen["prefix_hit_tokens"] > 0, seen
    if kind.endswith("_cached"):
        assert seen["checkpoint_saves"] > 0 and seen["checkpoints_evicted"] > 0, seen
    if any(g.spec.sliding_window is not None for g in groups):
        assert seen["given_back"] > 0, seen
    if kind == "compressed_cached":  # checkpoints read window blocks
        assert seen["window_blocks"] > 0, seen
