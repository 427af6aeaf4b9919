"""Penalties kept as incremental counts on the device equal the definitions applied to HF's logits, token for
token, through chunked prefill and preemption (a preempted request gives its row back and refills one when
it samples again)."""
from __future__ import annotations

import random

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ladle import LLM, SamplingParams
from ladle.runner.penalty_counts import PenaltyCounts


@torch.inference_mode()
def hf_penalized_greedy(model, prompt: list[int], max_new_tokens: int, p: SamplingParams) -> list[int]:
    """Greedy decoding over HF's logits with HF's repetition-penalty processor (prompt and output), then
    OpenAI's frequency and presence penalties on the output's counts (vLLM's order)."""
    rep = RepetitionPenaltyLogitsProcessor(p.repetition_penalty) if p.repetition_penalty != 1.0 else None
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = out.logits[0, -1:].float()
        if rep is not None:
            logits = rep(torch.tensor([prompt + tokens]), logits)
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=logits.shape[1]).float()
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        tokens.append(int(logits[0].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


PARAMS = [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=1.7, repetition_penalty=0.7),
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
]


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(17)
    # Few distinct tokens, so the penalties keep meeting tokens they have seen.
    return [[rng.randrange(40) for _ in range(rng.randrange(12, 60))] for _ in range(n)]


def test_penalties_equal_hf_under_chunking_and_preemption(tiny_qwen3_dir: str, hf_qwen3) -> None:
    prompts = _prompts(8)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    want = [hf_penalized_greedy(hf_qwen3, p, 14, sp) for p, sp in zip(prompts, params)]
    assert any(w != hf_penalized_greedy(hf_qwen3, p, 14, PARAMS[3]) for w, p in zip(want, prompts))
    # 12 blocks of 16 for 8 requests of up to 74 tokens: preemptions; 19-token chunks: prefills in pieces.
    llm = LLM(tiny_qwen3_dir, max_num_batched_tokens=64, num_kv_blocks=12, max_prefill_length=19, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats.num_preemptions > 0
    # Only as many rows as requests sample at once; the table is back to free once every request ended.
    counts = llm.engine.core.model_executor.runner.penalties
    assert counts.max_rows == 4 and len(counts.free) == 4


def test_counts_follow_fills_and_increments() -> None:
    counts = PenaltyCounts(3, 10, torch.device("cpu"))
    a, b = counts.take(), counts.take()
    counts.fill(a, [1, 1, 2], [3, 3])
    counts.fill(b, [], [9])
    counts.count([a, b, a], [3, 4, 5])
    assert counts.counts[a].tolist() == [0, 0, 0, 3, 0, 1, 0, 0, 0, 0]
    assert counts.counts[b].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert counts.prompt[a].nonzero()[:, 0].tolist() == [1, 2] and not counts.prompt[b].any()
    got, seen = counts.gather(torch.tensor([b, a]))
    assert torch.equal(got[1], counts.counts[a]) and torch.equal(seen[1], counts.prompt[a])
    counts.release(a)
    c = counts.take()
    counts.fill(c, [7], [])  # a reused row starts clean
    assert c == a and counts.counts[c].sum() == 0 and counts.prompt[c].nonzero()[:, 0].tolist() == [7]
    assert counts.take() is not None and counts.take() is None  # three rows, all held

