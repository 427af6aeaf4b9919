"""HF transformers as the oracle: its greedy loop (ladle.testing.hf_reference.hf_greedy), its logprobs, ladle's side."""
import torch

from ladle import LLM, SamplingParams
from ladle.testing.hf_reference import hf_greedy  # noqa: F401  (the tests' oracle, re-exported)


@torch.inference_mode()
def hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at each generated position, [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return torch.log_softmax(logits.float(), dim=-1)


def ladle_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """ladle's side of the comparison: each token-id prompt's output token ids, in prompt order."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_greedy_under_preemption(path: str, prompts: list[list[int]], want: list[list[int]], max_tokens: int,
                                   num_kv_blocks: int) -> None:
    """A pool too small for every admitted request forces preemptions; the greedy tokens still equal HF's
    (`want`), and every block is back in the pool at the end."""
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=num_kv_blocks, max_prefill_length=19)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == want
    assert llm.stats.num_preemptions > 0 and llm.engine.core.kv.num_free_blocks == num_kv_blocks
