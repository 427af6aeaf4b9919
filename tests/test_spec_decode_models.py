"""Speculative decoding beyond Qwen3's plain rows: Mistral's window, Qwen3-MoE, Qwen3.5's Gated DeltaNet state
rolled back to the last accepted draft, DeepSeek-V4's compressors likewise, and constrained rows drafting what
their grammar forces."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from test_spec_decode import GREEDY, drafting, spec


@pytest.fixture(scope="module")
def plain(tiny_qwen3_dir):
    return LLM(tiny_qwen3_dir, max_num_batched_tokens=64)


def _copy_prompts_for(path: str, n: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that repeat a span of the model's own greedy text (T + T[40:120], T a head and 120 greedy
    tokens), with their plain greedy tokens. Where attention sees a window of w tokens per layer, text after the
    repeat continues T itself once the span is longer than the layers' reach: every draft is accepted."""
    plain = LLM(path, max_num_batched_tokens=64, num_kv_blocks=256, max_model_len=1024)
    rng = random.Random(2)
    heads = [[rng.randrange(500) for _ in range(20)] for _ in range(n)]
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    texts = [h + c for h, c in zip(heads, ladle_tokens(plain, heads, long))]
    prompts = [t + t[40:120] for t in texts]
    return prompts, ladle_tokens(plain, prompts, GREEDY)


@pytest.mark.parametrize("family", ["mistral", "qwen3_moe"])
def test_other_families_keep_their_tokens(family, moe_dir, tmp_path_factory):
    """Mistral's window (24 tokens, mid-block) gives blocks back as a row's drafts come and go; Qwen3-MoE
    routes every draft position through its experts."""
    from ladle.demo import build_checkpoint

    path = moe_dir if family == "qwen3_moe" else build_checkpoint(
        tmp_path_factory.mktemp("mistral_spec"), "mistral", vocab_size=512, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=24,
        max_position_embeddings=32768, tie_word_embeddings=False, seed=4)
    prompts, want = _copy_prompts_for(path)
    llm = drafting(LLM(path, max_num_batched_tokens=64, num_kv_blocks=256, max_model_len=1024,
                       speculative_config=spec(4)))
    assert ladle_tokens(llm, prompts, GREEDY) == want
    assert llm.stats.spec_decode_num_accepted_tokens > 0
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_counts)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory) -> str:
    """Qwen3.5: three Gated DeltaNet layers, one gated full-attention layer."""
    from ladle.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("q35_spec"), "qwen3_5", vocab_size=512, hidden_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], seed=6)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_qwen3_5_rolls_its_state_back_to_the_last_accepted_draft(k, qwen3_5_dir):
    """A Gated DeltaNet state folds in every draft; a rejected one is undone by taking back the state kept after
    the last accepted token. Tokens equal the plain run's and HF's, chunked, preempted and from prefix hits."""
    prompts, want = _copy_prompts_for(qwen3_5_dir)
    llm = drafting(LLM(qwen3_5_dir, max_num_batched_tokens=64, max_prefill_length=19, max_model_len=1024,
                       speculative_config=spec(k)))
    assert ladle_tokens(llm, prompts, GREEDY) == want
    s = llm.stats
    assert s.spec_decode_num_accepted_tokens > 0
    if k > 1:  # drafts were rejected too, so states were rolled back
        assert s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens
    assert ladle_tokens(llm, prompts, GREEDY) == want and s.prefix_cache_hits > 0
    assert f"and {k} per request for the states after its drafts" in llm.engine.core.config.report()
    if k == 3:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(qwen3_5_dir, dtype=torch.float32).eval()
        assert want == [hf_greedy(hf, p, 32) for p in prompts]
        # 220-token prompts + 32 = 16 blocks each: 30 admit two, which outgrow them.
        tight = drafting(LLM(qwen3_5_dir, max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=1024,
                             speculative_config=spec(k)))
        assert ladle_tokens(tight, prompts, GREEDY) == want and tight.stats.num_preemptions > 0


def test_constrained_rows_draft_what_the_grammar_forces_and_keep_their_tokens(plain, tiny_qwen3_dir):
    """Every schema of the corpus, in greedy, seeded and penalized modes: the JSON with drafts is the plain
    run's, token for token; forced tokens (keys, punctuation) are drafted and accepted."""
    from ladle.sampling_params import StructuredOutputsParams as SO
    from structured_corpus import SCHEMAS

    llm = drafting(LLM(tiny_qwen3_dir, max_num_batched_tokens=64, speculative_config=spec(4)))
    modes = [dict(temperature=0), dict(temperature=1.0, seed=5), dict(temperature=0, frequency_penalty=0.5)]
    params = [SamplingParams(max_tokens=120, structured_outputs=SO(json=schema), **modes[i % len(modes)])
              for i, schema in enumerate(SCHEMAS)]
    prompts = ["Write the answer as JSON. " * 3] * len(params)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
    s = llm.stats
    assert s.spec_decode_num_accepted_tokens > 100
    assert s.spec_decode_num_draft_tokens >= s.spec_decode_num_accepted_tokens


SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@pytest.mark.parametrize("mix", ["sw_csa", "hca_sw"])
def test_deepseek_v4_rolls_its_compressors_back_to_the_last_accepted_draft(mix, tmp_path):
    """Each compressor keeps its pending projections (and its last complete window, overlapping CSA and the
    indexer) after every draft; a rejected draft takes them back, and an entry a rejected draft completed is
    written again when its group completes for real."""
    from ladle.demo import build_checkpoint

    layers = [SW, CSA] if mix == "sw_csa" else [HCA, SW]
    path = build_checkpoint(tmp_path / mix, "deepseek_v4", vocab_size=512, hidden_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                            intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32, num_experts_per_tok=2,
                            n_routed_experts=4, hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=2,
                            index_head_dim=16, index_topk=8, layer_types=layers, mlp_layer_types=["moe", "moe"],
                            sliding_window=16, compress_rates={CSA: 4, HCA: 8}, max_position_embeddings=4096,
                            seed=2)
    prompts, want = _copy_prompts_for(path)
    for k in (1, 3, 5):
        llm = drafting(LLM(path, max_num_batched_tokens=64, max_prefill_length=19, num_kv_blocks=256,
                           max_model_len=1024, speculative_config=spec(k)))
        assert ladle_tokens(llm, prompts, GREEDY) == want
        s = llm.stats
        assert s.spec_decode_num_accepted_tokens > 0
        if k > 1:
            assert s.spec_decode_num_draft_tokens > s.spec_decode_num_accepted_tokens
