"""Prefix caching: hits skip prefill work, outputs never change, blocks never leak, collisions serve nothing.

Unit tests drive KVCacheManager directly; the end-to-end tests compare against a caching-off engine or the HF
oracle, token for token (DESIGN.md invariant 6).
"""
import logging
import random

import pytest
import torch

from hf_oracle import hf_greedy
from ladle import LLM, SamplingParams
from ladle.startup.engine_config import EngineConfig
from ladle.demo import build_checkpoint
from ladle.kv_cache import prefix_tree
from ladle.kv_cache.manager import KVCacheManager
from ladle.frontend.llm_engine import LLMEngine
from ladle.engine.scheduler import Scheduler
from ladle.request import Request
from test_scheduler import advance


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, list(token_ids), SamplingParams(max_tokens=4), 4, frozenset())


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admission as the scheduler does it, then a full prefill; returns the hit tokens."""
    hit = kv.get_computed_blocks(req)
    assert kv.admit(req.request_id, req.num_tokens, req.num_tokens, req.num_tokens, hit)
    kv.cache_full_blocks(req, req.num_tokens)
    return hit.num_tokens


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_counts) and not any(kv.tables)


# --- KVCacheManager, no model ------------------------------------------------------------------------------

def test_hit_takes_leading_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(16, 4)
    a = request("a", range(1, 11))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    kv.free("a")
    assert kv.num_free_blocks == 16 and kv.pool.num_cached == 2  # freed, still cached
    assert kv.get_computed_blocks(request("b", list(range(1, 9)) + [99] * 4)).num_tokens == 8
    assert kv.get_computed_blocks(request("c", [1, 2, 3, 4, 9, 9, 9, 9])).num_tokens == 4  # second block differs
    assert kv.get_computed_blocks(request("d", [0] + list(range(2, 11)))).num_tokens == 0  # first block differs
    # Block-aligned and fully cached: capped at (8 - 1) // 4 blocks, so the last block is recomputed into a
    # block of the request's own and the shared one is never written.
    assert kv.get_computed_blocks(request("e", range(1, 9))).num_tokens == 4
    assert KVCacheManager(16, 4, enable_caching=False).get_computed_blocks(request("f", range(1, 9))).num_tokens == 0


def test_admission_counts_cached_blocks():
    kv = KVCacheManager(10, 4)
    a = request("a", range(1, 33))  # 8 blocks, still running
    admit(kv, a)
    b = request("b", list(range(1, 33)) + [7] * 4)  # needs 9 blocks; 8 are a's, shared
    blocks, hit = kv.get_computed_blocks(b)[:2]
    assert hit == 32 and kv.num_free_blocks == 2
    assert kv.num_blocks_to_allocate("b", b.num_tokens, blocks) == 1
    assert kv.allocate("b", b.num_tokens, blocks)
    assert kv.tables[0]["b"][:8] == kv.tables[0]["a"] and kv.num_free_blocks == 1
    assert all(kv.pool.ref_counts[i] == 2 for i in kv.tables[0]["a"])
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10 and not any(kv.pool.ref_counts)


def test_cached_free_blocks_cost_a_free_slot_and_are_evicted_lru_tail_first():
    kv = KVCacheManager(6, 4)
    a = request("a", range(1, 17))  # 4 blocks
    admit(kv, a)
    kv.free("a")
    blocks = kv.get_computed_blocks(request("x", list(range(1, 17)) + [5])).blocks
    assert len(blocks[0]) == 4 and kv.num_blocks_to_allocate("x", 17, blocks) == 5  # 1 new + 4 out of the queue
    admit(kv, request("c", [400 + i for i in range(12)]))  # 3 blocks: 2 never used, then a's tail block
    assert kv.pool.num_evictions == 1
    assert kv.get_computed_blocks(request("a2", list(range(1, 17)) + [5])).num_tokens == 12  # a's head survives


def test_constant_hash_never_serves_another_prefix(monkeypatch):
    monkeypatch.setattr(prefix_tree, "hash_block_tokens", lambda *key: 0)
    kv = KVCacheManager(16, 4)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    admit(kv, request("a", [1] * 4 + shared + [0]))
    # Same tokens in blocks 1 and 2 but another first block: same hash everywhere, and no hit.
    assert kv.get_computed_blocks(request("b", [2] * 4 + shared + [0])).num_tokens == 0
    assert kv.get_computed_blocks(request("c", [1] * 4 + shared[:4] + [0] * 5)).num_tokens == 8


# --- end to end --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_ctx_dir(tmp_path_factory):
    """A tiny Qwen3 that takes 16K-token prompts (the fixtures' models stop at 4096 positions)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_16k"), "qwen3", hidden_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            intermediate_size=64, max_position_embeddings=16640, seed=2)


def test_seed_b_long_prefix_is_computed_once(long_ctx_dir):
    """Seed B's workload: a 7.9K-token prefix served, then a 16K-token prompt that starts with it."""
    prefix = rand_ids(7900, seed=20)
    prompt = prefix + rand_ids(16000 - 7900, seed=21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(max_num_batched_tokens=2048, num_kv_blocks=1024)
    on = LLM(long_ctx_dir, **kwargs)
    on.generate({"prompt_token_ids": prefix}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert (on.stats.prefix_cache_queries, on.stats.prefix_cache_hits) == (7900, 0)
    got = on.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    hit = 7900 // 16 * 16
    assert on.stats.prefix_cache_hits == hit and on.stats.prefix_cache_queries == 7900 + 16000
    assert sum(got[0].outputs[0].prefill_chunks) == 16000 - hit  # only the uncached tokens
    assert got[0].num_cached_tokens == hit  # vLLM's RequestOutput field says so too
    off = LLM(long_ctx_dir, enable_prefix_caching=False, **kwargs)
    want = off.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert sum(want[0].outputs[0].prefill_chunks) == 16000 and off.stats.prefix_cache_queries == 0
    assert want[0].num_cached_tokens == 0
    assert token_ids(got) == token_ids(want)
    assert_no_leak(on)


@pytest.fixture(scope="module")
def chunked(tiny_qwen3_dir) -> dict[str, LLM]:
    """Caching on and off, chunked prefill (32 of a 64-token budget), 16 blocks of 16 tokens."""
    kwargs = dict(max_num_batched_tokens=64, max_prefill_length=32, num_kv_blocks=16)
    return {"on": LLM(tiny_qwen3_dir, **kwargs), "off": LLM(tiny_qwen3_dir, enable_prefix_caching=False, **kwargs)}


def test_shared_system_prompt_under_preemption_and_eviction(chunked):
    on, off = chunked["on"], chunked["off"]
    system = rand_ids(100, seed=30)
    prompts = [{"prompt_token_ids": system + rand_ids(10 + 3 * i, seed=31 + i)} for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=50 + i, max_tokens=12, ignore_eos=True) for i in range(8)]
    # A request needs up to 9 of the 16 blocks, the system prompt is 6 of them.
    hits, preemptions = on.stats.prefix_cache_hits, on.stats.num_preemptions
    computed_on, computed_off = on.stats.prompt_tokens, off.stats.prompt_tokens
    for params in (greedy, seeded):
        want = token_ids(off.generate(prompts, params, use_tqdm=False))
        assert token_ids(on.generate(prompts, params, use_tqdm=False)) == want
        assert_no_leak(on)
    assert on.stats.num_preemptions > preemptions and on.engine.core.kv.pool.num_evictions > 0
    assert on.stats.prefix_cache_hits - hits >= 2 * 7 * 96  # every request but the first hits the system prompt
    assert on.stats.prompt_tokens - computed_on < off.stats.prompt_tokens - computed_off


def test_abort_mid_chunked_prefill_then_reuse_its_prefix(tiny_qwen3_dir, hf_qwen3):
    engine = LLMEngine.from_kwargs(model=tiny_qwen3_dir, max_num_batched_tokens=56)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = rand_ids(300, seed=40)
    engine.add_request("a", None, prompt, params)
    for _ in range(3):
        engine.step()
    core = engine.core
    assert core.scheduler.find("a").num_computed_tokens == 168  # 10.5 blocks written
    engine.abort_request(["a"])
    assert not engine.has_unfinished_requests() and core.kv.num_free_blocks == core.kv.num_blocks
    assert core.kv.pool.num_cached == 10  # the half-written block is not cached
    b, c = prompt[:200] + rand_ids(30, seed=41), prompt[:200] + rand_ids(25, seed=42)
    engine.add_request("b", None, b, params)
    engine.add_request("c", None, c, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["b"].outputs[0].token_ids == hf_greedy(hf_qwen3, b, 10)
    assert done["c"].outputs[0].token_ids == hf_greedy(hf_qwen3, c, 10)
    # b hits a's 10 written blocks; c waits a step for b, then hits the 12 blocks it shares with b.
    assert core.stats.prefix_cache_hits == 160 + 192


def test_block_aligned_full_hit_never_writes_the_shared_block(tiny_qwen3_dir, hf_qwen3, caplog):
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64)
    core = llm.engine.core
    prompt = rand_ids(64, seed=60)  # exactly 4 blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    cached = sorted(core.kv.pool.cached_blocks.values())
    assert len(cached) == 4
    before = [(k[cached].clone(), v[cached].clone()) for k, v in core.model_executor.runner.kv_caches]
    with caplog.at_level(logging.DEBUG, logger="ladle.scheduler"):
        again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert core.stats.prefix_cache_hits == 48  # the last block is recomputed, into a block of its own
    assert "prefill chunk request=1 chunk_size=16 remain=16 cached=48" in caplog.text  # diagnostics see hits
    for (k, v), (k0, v0) in zip(core.model_executor.runner.kv_caches, before):
        assert torch.equal(k[cached], k0) and torch.equal(v[cached], v0)
    longer = prompt + rand_ids(16, seed=61)
    third = llm.generate({"prompt_token_ids": longer}, params, use_tqdm=False)
    assert core.stats.prefix_cache_hits == 48 + 64
    want = hf_greedy(hf_qwen3, prompt, 4)
    assert token_ids(first) == token_ids(again) == [want]
    assert token_ids(third) == [hf_greedy(hf_qwen3, longer, 4)]


def test_n_siblings_share_the_prompt_blocks(chunked, hf_qwen3):
    on, off = chunked["on"], chunked["off"]
    prompt = rand_ids(100, seed=70)
    hits, computed = on.stats.prefix_cache_hits, on.stats.prompt_tokens
    out = on.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True),
                      use_tqdm=False)
    assert token_ids(out) == [hf_greedy(hf_qwen3, prompt, 6)] * 4
    # Added together, the siblings wait for the first one's prefill and then hit its 6 full blocks.
    assert on.stats.prefix_cache_hits - hits == 3 * 96 and on.stats.prompt_tokens - computed == 100 + 3 * 4
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    want = token_ids(off.generate({"prompt_token_ids": prompt}, seeded, use_tqdm=False))
    assert token_ids(on.generate({"prompt_token_ids": prompt}, seeded, use_tqdm=False)) == want
    assert_no_leak(on)


def test_hash_collisions_cannot_serve_wrong_kv(tiny_qwen3_dir, hf_qwen3, monkeypatch):
    monkeypatch.setattr(prefix_tree, "hash_block_tokens", lambda *key: 0)  # every block collides
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64)
    shared = rand_ids(48, seed=80)
    a = rand_ids(16, seed=81) + shared + [3]
    b = rand_ids(16, seed=82) + shared + [4]  # same blocks 1..3 as a, behind another first block
    c = a[:48] + rand_ids(20, seed=83)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False) for p in (a, b, c)]
    assert llm.stats.prefix_cache_hits == 0 + 0 + 48
    for p, out in zip((a, b, c), outs):
        assert token_ids(out) == [hf_greedy(hf_qwen3, p, 6)]


def scheduler() -> Scheduler:
    """32 blocks of 4 tokens, a budget of 64, prefix caching on."""
    cfg = EngineConfig(model="m", tokenizer="m", device=torch.device("cpu"), dtype=torch.float32, max_model_len=64,
                       max_num_batched_tokens=64, max_prefill_length=64, max_num_seqs=8, block_size=4,
                       num_kv_blocks=32, seed=0)
    return Scheduler(cfg, KVCacheManager(32, 4))


def test_scheduler_defers_a_request_whose_prefix_is_being_written():
    sched = scheduler()
    kv = sched.kv
    first, second, other = request("first", range(1, 19)), request("second", range(1, 19)), request("x", [9] * 8)
    for r in (first, second, other):
        sched.add(r)
    out = sched.schedule()  # second would recompute first's blocks: it waits, and x behind it goes ahead
    assert [s.request.request_id for s in out.scheduled] == ["first", "x"] and list(sched.waiting) == [second]
    advance(sched, out)  # what the core does after the step ran
    out = sched.schedule()
    admitted = [s for s in out.scheduled if s.request is second]
    assert admitted[0].start_pos == 16 and admitted[0].num_new_tokens == 2 and out.prefix_cache_hits == 16
    assert kv.tables[0]["second"][:4] == kv.tables[0]["first"][:4]


def test_preempted_request_hits_its_own_blocks_on_readmission():
    sched = scheduler()
    kv = sched.kv
    r = request("r", range(1, 19))
    sched.add(r)
    advance(sched, sched.schedule())
    sched._preempt(r)  # frees its blocks, which keep their hashes
    assert r.num_computed_tokens == 0 and kv.num_free_blocks == 32 and kv.pool.num_cached == 4
    (s,) = sched.schedule().scheduled
    assert s.start_pos == 16 and s.num_new_tokens == 3 and r.num_cached_tokens == 16
