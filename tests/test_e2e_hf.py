"""Token-for-token equality with HF transformers greedy generation, through the offline LLM path."""
import random

import pytest
import torch

from ladle import LLM, SamplingParams

PROMPT_LENS = [1, 3, 17, 64, 150, 600]
NEW_TOKENS = 8
CONFIGS = [  # (max_num_batched_tokens, max_prefill_length): 1 is the smallest budget allowed
    (1, None), (7, None), (7, 5), (64, None), (64, 5), (64, 32), (4096, None), (4096, 32),
]


def random_prompts(vocab, lens, seed):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def case(request):
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = request.getfixturevalue(f"hf_{request.param}")
    prompts = random_prompts(hf.config.vocab_size, PROMPT_LENS, seed=len(request.param))
    with torch.inference_mode():
        expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return model_dir, prompts, expected


@pytest.mark.parametrize("budget,chunk", CONFIGS)
def test_greedy_equals_hf_for_every_budget_and_chunk(case, budget, chunk):
    model_dir, prompts, expected = case
    kwargs = {"max_num_batched_tokens": budget}
    if chunk is not None:
        kwargs["max_prefill_length"] = chunk
    llm = LLM(model_dir, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    limit = min(budget, chunk or budget)
    assert llm.stats.max_step_tokens <= budget
    assert all(s.num_tokens <= budget for s in llm.stats.steps)
    assert all(c <= limit for o in outs for c in o.outputs[0].prefill_chunks)
    assert [sum(o.outputs[0].prefill_chunks) for o in outs] == PROMPT_LENS  # no preemption here: each prompt once


def test_single_prompts_equal_hf(case):
    model_dir, prompts, expected = case
    llm = LLM(model_dir, max_num_batched_tokens=64, max_prefill_length=32)
    for p, e in zip(prompts, expected):
        out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == e
