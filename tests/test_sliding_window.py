"""Sliding-window attention (Mistral, and Qwen3 with use_sliding_window) against HF transformers, token for
token in fp32 on CPU; and the saving it promises: a long request holds a bounded number of blocks."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.kv_cache.specs import blocks_held

WINDOW = 24  # not a multiple of the block size (16), so windows start mid-block
PROMPT_LENS = [1, 5, 23, 24, 25, 50, 4 * WINDOW]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CONFIGS = [(b, c) for b in (1, 7, 64, 4096) for c in (None, 5, 32) if c is None or c <= b]
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96)


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module", params=["mistral", "qwen3-mixed"])
def case(request, tmp_path_factory):
    """Mistral: every layer windowed (one KV group). Qwen3 with max_window_layers=1: layer 0 full, layers 1-2
    windowed (two groups sharing the pool)."""
    from transformers import AutoModelForCausalLM

    from ladle.demo import build_checkpoint

    if request.param == "mistral":
        path = build_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", **SMALL, sliding_window=WINDOW,
                                max_position_embeddings=32768, tie_word_embeddings=False, seed=4)
    else:
        path = build_checkpoint(tmp_path_factory.mktemp("qwen3sw"), "qwen3", **SMALL, use_sliding_window=True,
                                sliding_window=WINDOW, max_window_layers=1, max_position_embeddings=4096, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(PROMPT_LENS, 21)
    return path, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("budget,chunk", CONFIGS)
def test_greedy_equals_hf_for_every_budget_and_chunk(case, budget, chunk):
    path, _, prompts, want = case
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(path, num_kv_blocks=256, max_model_len=1024, **kwargs)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    hits = llm.stats.prefix_cache_hits
    # Served from the prefix cache:
    assert ladle_tokens(llm, prompts, GREEDY) == want and llm.stats.prefix_cache_hits > hits
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_counts)


def test_greedy_equals_hf_under_preemption(case):
    path, hf, _, _ = case
    prompts = _prompts([40] * 6, 22)
    want = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=12, max_model_len=1024)
    assert ladle_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) == want
    assert llm.stats.num_preemptions > 0
    assert llm.engine.core.kv.num_free_blocks == 12


def test_a_long_request_holds_a_bounded_number_of_blocks(tmp_path):
    """A 16K-token Mistral prompt with a 512-token window, prefilled 512 tokens a step: the request never holds
    more than its window's blocks, and the pool is whole again afterwards."""
    from ladle.demo import build_checkpoint

    path = build_checkpoint(tmp_path / "long", "mistral", vocab_size=512, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                            sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=False)
    llm = LLM(path, max_num_batched_tokens=512, num_kv_blocks=200, max_model_len=17000)
    core = llm.engine.core
    bound = blocks_held(512, 16384 + 16, 16, 512)
    assert bound < 100 < -(-16384 // 16)  # the whole prompt would need 1024 blocks; the pool has 200
    req = core.make_request("long", _prompts([16384], 3)[0], SamplingParams(max_tokens=16, ignore_eos=True))
    core.add_request(req)
    held = []
    while core.has_unfinished_requests():
        core.step()
        held.append(core.kv.held_blocks("long"))
    assert req.num_output_tokens == 16 and len(held) > 32
    assert max(held) <= bound, (max(held), bound)
    assert core.kv.num_free_blocks == core.kv.num_blocks
