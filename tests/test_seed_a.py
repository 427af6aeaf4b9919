"""Seed report 000: 16 x 3,338-token prompts through the offline path with max_num_batched_tokens=1024.

The engine of that report prefilled each prompt in one call and deadlocked its allocator; here every forward
call is bounded by the budget and each prompt is split into chunks whose KV carries over.
"""
import random

from hf_oracle import hf_greedy
from ladle import LLM, SamplingParams

PROMPT_TOKENS, NUM_PROMPTS, BUDGET, NEW_TOKENS = 3338, 16, 1024, 20


def test_seed_a_offline_batch_is_chunked_and_correct(tiny_qwen3_dir, hf_qwen3):
    rng = random.Random(0)
    vocab = hf_qwen3.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=BUDGET, max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate_batch([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    stats = llm.stats
    assert stats.max_step_tokens <= BUDGET
    assert all(s.num_tokens <= BUDGET for s in stats.steps)
    for o in outs:
        chunks = o.outputs[0].prefill_chunks
        assert len(chunks) >= 4 and sum(chunks) == PROMPT_TOKENS and max(chunks) <= BUDGET
        assert len(o.outputs[0].token_ids) == NEW_TOKENS
    for i in (0, NUM_PROMPTS - 1):
        assert outs[i].outputs[0].token_ids == hf_greedy(hf_qwen3, prompts[i], NEW_TOKENS)
