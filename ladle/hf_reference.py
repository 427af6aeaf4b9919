"""HF transformers as a peer or an oracle on CPU: its Gated DeltaNet models call flash-linear-attention's
(and causal-conv1d's) Triton kernels whenever those packages import, whatever the tensors' device, and those
kernels cannot run on a CPU. use_torch_kernels puts HF's own PyTorch reference back in those models."""
from __future__ import annotations

import importlib

# HF modules whose linear-attention layers call these module-level functions; each is HF's PyTorch version
# wrapped by use_kernel_func_from_hub_with_fallback, which keeps it as __wrapped__.
_MODULES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
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
