"""Decode at depth: a context past 1,024 tokens is attended in splits over the threads (flash-decoding, in the C
kernel); greedy tokens still equal HF's on a full-attention model and on a window wider than a split, prompts of
about 4.5K tokens, prefilled in chunks."""
from __future__ import annotations

import random

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint

SHAPE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=8192)


@pytest.mark.slow
@pytest.mark.parametrize("arch, extra", [("qwen3", {}), ("mistral", {"sliding_window": 1500})])
def test_greedy_at_depth_equals_hf(tmp_path, arch, extra):
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(tmp_path / arch, arch, **SHAPE, **extra, seed=9)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (4500, 1030, 2100)]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(path, max_num_batched_tokens=1024, max_model_len=4600)
    assert ladle_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == want
