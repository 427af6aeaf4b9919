"""Session-aware retention (ladle.kv_cache.session_retention): what a live session will send again is evicted after
everything else, in the device pool, the host tier and the state checkpoints, and no token changes."""
from __future__ import annotations

import random

import pytest

from ladle import LLM, SamplingParams
from ladle.kv_cache.block_pool import BlockPool
from ladle.kv_cache.host_tier import HostTier
from ladle.kv_cache.session_retention import SessionRetention
from ladle.kv_cache.state_checkpoints import StateCheckpoints

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_keeps_its_latest_turn_and_lapses_after_its_time():
    changes: list[tuple[int, bool]] = []
    clock = Clock()
    sessions = SessionRetention(lambda node, kept: changes.append((node, kept)), ttl_s=10, clock=clock)
    sessions.record("a", [1, 2, 3])
    sessions.record("b", [1, 2, 7])  # the shared prefix, kept by both
    assert changes == [(1, True), (2, True), (3, True), (7, True)] and len(sessions) == 2
    changes.clear()
    sessions.record("a", [1, 2, 3, 4, 5])  # a's next turn: what it keeps grows
    assert changes == [(4, True), (5, True)]
    changes.clear()
    sessions.record("a", [1, 2, 8])  # a re-rendered tail: the old one is let go in prefix order (the pool puts
    assert changes == [(8, True), (3, False), (4, False), (5, False)]  # each first, so the deepest ends first)
    changes.clear()
    clock.now = 5
    sessions.record("b", [1, 2, 7])
    clock.now = 12  # a's last turn ended 12 s ago, b's 7 s ago
    sessions.expire()
    assert changes == [(8, False)] and len(sessions) == 1 and sessions.kept(1) and not sessions.kept(8)
    clock.now = 16
    sessions.expire()
    assert not sessions.num_kept_nodes and sessions.num_lapsed == 2


def test_a_session_keeps_only_its_deepest_checkpoint():
    """Each turn's checkpoint replaces the last: a hit needs only the deepest on its path, and keeping every
    turn's would fill the slots with one session's."""
    sessions = SessionRetention(lambda node, kept: None)
    sessions.record("a", [1, 2, 3], checkpoint=3)
    sessions.record("b", [1, 2, 4], checkpoint=4)
    assert sessions.kept_checkpoint(3) and sessions.kept_checkpoint(4) and not sessions.kept_checkpoint(2)
    sessions.record("a", [1, 2, 3, 5, 6], checkpoint=6)
    assert not sessions.kept_checkpoint(3) and sessions.kept_checkpoint(6) and sessions.kept(3)
    sessions.clear()
    assert not sessions.kept_checkpoint(4) and not sessions.kept_checkpoint(6)


def test_past_max_sessions_the_least_recently_active_lapses():
    sessions = SessionRetention(lambda node, kept: None, max_sessions=2)
    for i in range(3):
        sessions.record(f"s{i}", [i])
    assert len(sessions) == 2 and not sessions.kept(0) and sessions.kept(1) and sessions.kept(2)
    with pytest.raises(ValueError, match="ttl_s > 0"):
        SessionRetention(lambda node, kept: None, ttl_s=0)


def test_the_pool_evicts_kept_blocks_only_when_no_other_is_free():
    kept = {10}
    evicted: list[int] = []
    pool = BlockPool(4, on_evict=lambda block, key: evicted.append(key[0]), kept=kept.__contains__)
    ids = pool.allocate(4)
    for i, node in zip(ids, (10, 11, 12, 13)):
        pool.cache_block(i, (node, 0))
    pool.release(ids)  # 10 was released first: plain LRU would evict it first
    assert pool.num_free == 4 and list(pool.kept_queue) == [ids[0]]
    pool.allocate(3)
    assert evicted == [13, 12, 11]  # a request's tail before its head, the kept block last
    pool.allocate(1)
    assert evicted[-1] == 10


def test_a_block_whose_session_moves_on_goes_first():
    kept: set[int] = set()
    evicted: list[int] = []
    pool = BlockPool(3, on_evict=lambda block, key: evicted.append(key[0]), kept=kept.__contains__)
    ids = pool.allocate(3)
    for i, node in zip(ids, (20, 21, 22)):
        pool.cache_block(i, (node, 0))
    pool.release(ids)
    kept.add(21)
    pool.requeue(ids[1], True)
    assert list(pool.kept_queue) == [ids[1]]
    kept.discard(21)
    pool.requeue(ids[1], False)  # no longer kept: first out
    pool.allocate(1)
    assert evicted == [21]
    pool.touch([ids[0]])  # a hit on a free block takes it out of whichever queue holds it
    assert pool.num_free == 1


def test_the_host_tier_and_the_checkpoints_drop_kept_entries_last():
    kept = {1}
    dropped: list[int] = []
    tier = HostTier(2, dropped.append, kept.__contains__)
    assert tier.demote((1, 0), 5) and tier.demote((2, 0), 6)
    tier.take_transfers()
    assert tier.demote((3, 0), 7) and dropped == [2]
    assert tier.demote((4, 0), 8) and dropped == [2, 3]
    kept.add(4)
    assert tier.demote((5, 0), 9) and dropped == [2, 3, 1]  # every entry kept: least recently used

    gone: list[int] = []
    checkpoints = StateCheckpoints(2, 4, 100, lambda node, row, valid: gone.append(node), kept={7}.__contains__)
    for node in (7, 8):
        checkpoints.register(node, checkpoints.take())
    checkpoints.take()
    assert gone == [8] and checkpoints.has(7)


def _run(llm: LLM, rid: str, ids: list[int], session: str | None) -> tuple[list[int], int]:
    engine = llm.engine
    engine.add_request(rid, None, ids, GREEDY, session_id=session)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids), out.num_cached_tokens


def _agents_and_one_offs(llm: LLM, hints: bool, seed: int = 0) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Three sessions sharing a system prompt take turns; between turns, one-off requests with no session (a
    title, a batch job) pass through a pool that holds the sessions and little more. Returns every reply and
    (new, computed) prompt tokens of each later turn."""
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(32)]
    history = {s: system + [rng.randrange(500) for _ in range(40)] for s in range(3)}
    replies, counts = [], []
    for turn in range(3):
        for s in range(3):
            reply, cached = _run(llm, f"s{s}t{turn}", history[s], f"session-{s}" if hints else None)
            replies.append(reply)
            if turn:
                counts.append((8 + 12, len(history[s]) - cached))
            history[s] = history[s] + reply + [rng.randrange(500) for _ in range(12)]
        for k in range(3):
            reply, _ = _run(llm, f"once{turn}-{k}", [rng.randrange(500) for _ in range(88)], None)
            replies.append(reply)
    return replies, counts


def test_one_off_requests_do_not_flush_the_sessions_and_no_token_changes(tiny_qwen3_dir):
    """27 blocks hold the system prompt, the three sessions' histories and one one-off; without hints the
    one-offs push the sessions' oldest blocks out (plain LRU), with them they recycle their own."""
    roomy, _ = _agents_and_one_offs(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), False)
    plain_out, plain = _agents_and_one_offs(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=27), False)
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=27)
    kept_out, kept = _agents_and_one_offs(llm, True)
    assert kept_out == plain_out == roomy
    block = llm.config.block_size
    assert all(computed <= new + block for new, computed in kept), kept  # each turn computes what is new
    assert sum(c for _, c in plain) > 2 * sum(c for _, c in kept), (plain, kept)
    kv = llm.engine.core.kv
    assert len(kv.sessions) == 3 and kv.sessions.num_kept_nodes > 0
    snap = llm.engine.core.snapshot()
    assert snap.prefix_cache_sessions == 3 and snap.prefix_cache_kept_nodes == kv.sessions.num_kept_nodes
    assert llm.engine.core.reset_prefix_cache() and len(kv.sessions) == 0


def test_sessions_keep_their_prefixes_in_the_host_tier_too(tiny_qwen3_dir):
    """A pool smaller than the sessions and a host tier that holds them and little more: the one-offs the pool
    evicts into the host tier are dropped there before any session's blocks."""
    roomy, _ = _agents_and_one_offs(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=256), False, 1)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x fp32
    args = dict(max_num_batched_tokens=64, num_kv_blocks=12, kv_offloading_size=16 * block_bytes)
    plain_out, plain = _agents_and_one_offs(LLM(tiny_qwen3_dir, **args), False, 1)
    llm = LLM(tiny_qwen3_dir, **args)
    kept_out, kept = _agents_and_one_offs(llm, True, 1)
    assert kept_out == plain_out == roomy
    assert sum(c for _, c in plain) > 2 * sum(c for _, c in kept), (plain, kept)
    tier = llm.engine.core.kv.host
    assert tier is not None and tier.num_dropped > 0 and tier.num_promoted > 0


def test_a_state_model_keeps_its_sessions_checkpoints(q35_dir):
    """Qwen3.5 (Gated DeltaNet): a hit needs a state checkpoint; four checkpoint slots for three sessions, and
    one-offs that would take them: each session's latest checkpoint stays, and the tokens are the roomy run's."""
    path = q35_dir
    roomy, _ = _agents_and_one_offs(LLM(path, max_num_batched_tokens=64, num_kv_blocks=256), False, 2)
    args = dict(max_num_batched_tokens=64, num_kv_blocks=256, num_state_checkpoints=4)
    plain_out, plain = _agents_and_one_offs(LLM(path, **args), False, 2)
    kept_out, kept = _agents_and_one_offs(LLM(path, **args), True, 2)
    assert kept_out == plain_out == roomy
    assert sum(c for _, c in plain) > 2 * sum(c for _, c in kept), (plain, kept)
