"""Qwen3-MoE against HF transformers (fp32, CPU): token for token under every step budget and chunk cap, with
prefix caching and under preemption; the router's arithmetic; and a plan that holds for the worst routing."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.startup.memory import measure_peak
from ladle.models.layers.moe import SparseMoeBlock, route
from ladle.runner.step_batch import StepBatch
from ladle.runner.sampling_batch import sampling_metadata

PROMPT_LENS = [1, 3, 17, 64, 150]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# (max_num_batched_tokens, max_prefill_length): every budget x cap the issue names, where the cap fits.
CONFIGS = [(b, c) for b in (1, 7, 64, 4096) for c in (None, 5, 32) if c is None or c <= b]


@pytest.fixture(scope="module")
def hf_moe(moe_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def expected(hf_moe) -> tuple[list[list[int]], list[list[int]]]:
    prompts = _prompts(PROMPT_LENS, 11)
    return prompts, [hf_greedy(hf_moe, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("budget,chunk", CONFIGS)
def test_greedy_equals_hf_for_every_budget_and_chunk(moe_dir, expected, budget, chunk):
    prompts, want = expected
    kwargs = {"max_num_batched_tokens": budget} | ({"max_prefill_length": chunk} if chunk else {})
    llm = LLM(moe_dir, num_kv_blocks=128, **kwargs)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert llm.stats.max_step_tokens <= budget
    # A second identical pass is served from the prefix cache and gives the same tokens.
    hits = llm.stats.prefix_cache_hits
    assert ladle_tokens(llm, prompts, GREEDY) == want and llm.stats.prefix_cache_hits > hits


def test_greedy_equals_hf_under_preemption(moe_dir, hf_moe):
    prompts = _prompts([40] * 6, 12)
    want = [hf_greedy(hf_moe, p, 24) for p in prompts]
    # 40 + 24 tokens = 4 blocks per request: 9 blocks hold about 2 of the 6, so decodes preempt.
    llm = LLM(moe_dir, max_num_batched_tokens=128, num_kv_blocks=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats.num_preemptions > 0 and llm.engine.core.kv.num_free_blocks == 9


def test_router_matches_hf_arithmetic():
    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    for renormalize in (True, False):
        weights, ids = route(logits, 2, renormalize, torch.float32)
        probs = torch.softmax(logits, dim=-1)
        top, top_ids = probs.topk(2, dim=-1)
        assert torch.equal(ids, top_ids)
        assert torch.allclose(weights, top / top.sum(-1, keepdim=True) if renormalize else top)


def test_a_step_with_every_token_on_the_same_experts_stays_within_the_plan(tmp_path):
    """Experts wide enough that their activations dominate a step: sending every token of a full step at the
    longest context through the same experts costs far more than the step's natural routing, and the plan
    (profiled under that worst routing) still covers it."""
    from ladle.demo import build_checkpoint

    wide = build_checkpoint(tmp_path / "wide", "qwen3_moe", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                            moe_intermediate_size=1024, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=2048, seed=3)
    llm = LLM(wide, max_num_batched_tokens=512, max_model_len=2048)
    core = llm.engine.core
    blocks = list(range(-(-2048 // core.config.block_size)))
    tokens = _prompts([512], 5)[0]
    step = StepBatch().add(tokens, 2048 - 512, blocks, True)
    meta = sampling_metadata([SamplingParams(temperature=0)], 512, prompts=[tokens])
    moe = [m for m in core.model_executor.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    peaks = {}
    for force in (False, True):
        for m in moe:
            m.force_worst_routing = force
        peaks[force] = measure_peak(lambda: core.model_executor.runner.run(step, meta), torch.device("cpu"))
    for m in moe:
        m.force_worst_routing = False
    assert peaks[True] > 1.5 * peaks[False], peaks  # the worst routing is what costs
    assert peaks[True] <= core.config.plan.activation_peak, (peaks, core.config.plan.activation_peak)
