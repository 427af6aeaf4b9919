"""HF transformers as the oracle: a greedy loop over its own KV cache that never suppresses EOS.

`generate(min_new_tokens=...)` would mask EOS logits, which ladle's ignore_eos must not do, so the loop is
written out; it is what `generate` does for greedy decoding otherwise.
"""
import torch


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    tokens: list[int] = []
    while True:
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
        if len(tokens) == max_new_tokens or tok in stop_ids:
            return tokens
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)


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
