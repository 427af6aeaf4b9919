"""The per-expert loop every MoE layer on the torch path runs, resident or tiered: tokens grouped by expert, one
SwiGLU per routed expert, results added in expert order."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ladle.quantization.layer_interfaces import ExpertStack


def each_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                mlp: Callable[[torch.Tensor, int], torch.Tensor],
                on_counts: Callable[[list[int]], None] | None = None) -> torch.Tensor:
    """The step's tokens grouped by expert, mlp(rows, expert) once for each expert that has tokens, the
    weighted results added in expert order (as HF transformers does, so fp32 outputs match it). on_counts sees
    each expert's token count before the first runs (a tiered layer fetches from it)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    if on_counts is not None:
        on_counts(counts)
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // top_k
        out.index_add_(0, tokens, mlp(x[tokens], expert) * flat_weights[pairs, None])
    return out


def expert_mlp(x: torch.Tensor, w13: torch.Tensor | ExpertStack, w2: torch.Tensor | ExpertStack, expert: int,
               swiglu_limit: float | None) -> torch.Tensor:
    """One expert's SwiGLU over its rows: stack[expert] of w13 [E, 2I, H] and w2 [E, H, I]."""
    gate, up = _expert_linear(x, w13, expert).chunk(2, dim=-1)
    if swiglu_limit is not None:  # DeepSeek-V4 clamps both halves
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return _expert_linear(F.silu(gate) * up, w2, expert)


def _expert_linear(x: torch.Tensor, stack: torch.Tensor | ExpertStack, expert: int) -> torch.Tensor:
    """x @ stack[expert]^T, by the stack's own product where it has one (packed MXFP4 read in C)."""
    return stack.linear(x, expert) if isinstance(stack, ExpertStack) else F.linear(x, stack[expert])
