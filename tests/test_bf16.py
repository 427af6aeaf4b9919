"""bfloat16 on CPU against HF transformers in bfloat16: greedy tokens agree, and where a request's tokens part,
they part at a rounding tie (the float32 margin between the two picks is within HF bf16's own logit error at
that position), never where float32 clearly prefers HF's pick. Token-for-token equality in every
chunking is the fp32 invariant; bf16 sums in another order when a prefill is chunked, so it can flip a tie."""
import pytest
import torch
from hf_oracle import hf_greedy
from test_e2e_hf import random_prompts
from transformers import AutoModelForCausalLM

from ladle import LLM, SamplingParams
from ladle.testing.hf_reference import first_divergence, rounding_tie

PROMPT_LENS = [3, 17, 64, 150]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def bf16_case(request):
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = {dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
          for dt in (torch.bfloat16, torch.float32)}
    prompts = random_prompts(hf[torch.float32].config.vocab_size, PROMPT_LENS, seed=11)
    expected = [hf_greedy(hf[torch.bfloat16], p, NEW_TOKENS) for p in prompts]
    return model_dir, hf, prompts, expected


@pytest.mark.parametrize("budget,chunk", [(4096, None), (7, 5)])
def test_bf16_greedy_parts_from_hf_bf16_only_at_rounding_ties(bf16_case, budget, chunk):
    model_dir, hf, prompts, expected = bf16_case
    llm = LLM(model_dir, dtype="bfloat16", max_num_batched_tokens=budget,
              **({"max_prefill_length": chunk} if chunk else {}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    same = 0
    for prompt, out, want in zip(prompts, outs, expected):
        got = out.outputs[0].token_ids
        j = first_divergence(got, want)
        if j is None:
            same += 1
            continue
        prefix = torch.tensor([prompt + got[:j]])
        with torch.inference_mode():
            ref, low = (hf[dt](prefix).logits[0, -1].float() for dt in (torch.float32, torch.bfloat16))
        tie = rounding_tie(ref, low, got[j], want[j])
        assert tie["rounding"], (f"token {j} of a {len(prompt)}-token prompt: ladle {got[j]}, HF {want[j]}, "
                                 f"float32 margin {tie['reference_margin']:.4f} > HF bf16's logit error "
                                 f"{tie['low_precision_logit_error']:.4f}")
    assert same >= len(prompts) // 2  # ties are rare: most requests agree to the last token
