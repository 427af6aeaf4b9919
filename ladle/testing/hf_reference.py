"""HF transformers as a peer or an oracle on CPU: its Gated DeltaNet models call flash-linear-attention's
(and causal-conv1d's) Triton kernels whenever those packages import, whatever the tensors' device, and those
kernels cannot run on a CPU. use_torch_kernels puts HF's own PyTorch reference back in those models.
In bf16, greedy tokens can part at a near-tie; rounding_tie tells a tie from a real difference."""
from __future__ import annotations

import importlib
from typing import Any

# HF modules whose linear-attention layers call these module-level functions; each is HF's PyTorch version
# wrapped by use_kernel_func_from_hub_with_fallback, which keeps it as __wrapped__.
_MODULES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp")
_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
              "causal_conv1d_update")


def use_torch_kernels() -> list[str]:
    """Make HF's Gated DeltaNet models run their PyTorch reference; returns the functions replaced."""
    replaced = []
    for name in _MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for fn_name in _FUNCTIONS:
            fn = getattr(module, fn_name, None)
            torch_fn = getattr(fn, "__wrapped__", None)
            if torch_fn is not None and torch_fn is not fn:
                setattr(module, fn_name, torch_fn)
                replaced.append(f"{name}.{fn_name}")
    return replaced


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token sequences differ (None when one is a prefix of the other)."""
    return next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def rounding_tie(reference_logits: Any, low_precision_logits: Any, ours: int, theirs: int) -> dict[str, Any]:
    """Whether two engines' different greedy picks at one position are a rounding tie: the reference's (float32)
    margin between the two tokens is no larger than the low-precision model's own logit error at that position
    (its largest |low - reference| over the vocabulary), so at that precision the model's ranking of the two is
    noise. Both logit vectors are for the same prefix."""
    margin = float(reference_logits[ours] - reference_logits[theirs])  # > 0: the reference agrees with ours
    error = float((low_precision_logits.float() - reference_logits.float()).abs().max())
    return {"reference_margin": margin, "low_precision_logit_error": error, "rounding": abs(margin) <= error,
            "reference_argmax": int(reference_logits.argmax())}


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int,
              stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """Greedy tokens from HF's own KV-cache loop, which never suppresses EOS: `generate(min_new_tokens=...)`
    would mask EOS logits, which ladle's ignore_eos does not do; otherwise this is what `generate` does."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens: list[int] = []
        while True:
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
            if len(tokens) == max_new_tokens or tok in stop_ids:
                return tokens
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
