"""Mixture-of-experts MLP: a top-k softmax router and the experts' weights stacked into two tensors.

The experts of a layer are one `w13 [E, 2I, H]` (gate rows, then up rows) and one `w2 [E, H, I]`, filled at
load from the checkpoint's per-expert `experts.{j}.{gate,up,down}_proj.weight` (vLLM's FusedMoE layout). The
torch path groups a step's tokens by expert and runs one matmul pair per expert that has tokens, adding the
weighted results in expert order, as HF transformers does, so fp32 outputs match it. On CUDA the experts run
as Triton grouped GEMMs over expert-sorted blocks (ladle.worker.triton_moe).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.layers import use_triton_ops


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in dtype, expert ids [T, k]): softmax in fp32, top-k, and
    renormalised over the k when the config's norm_topk_prob says so (HF's order of operations)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported for experts; only 'silu'")
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """Checkpoint name -> (parameter name, the view of it that tensor fills)."""
        size = self.intermediate_size
        views: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
        for j in range(self.num_experts):
            views[f"{prefix}.{j}.gate_proj.weight"] = (f"{prefix}.w13", lambda p, j=j: p[j, :size])
            views[f"{prefix}.{j}.up_proj.weight"] = (f"{prefix}.w13", lambda p, j=j: p[j, size:])
            views[f"{prefix}.{j}.down_proj.weight"] = (f"{prefix}.w2", lambda p, j=j: p[j])
        return views

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> [T, H]."""
        if use_triton_ops(x):
            from ladle.worker import triton_moe  # CUDA only: grouped GEMMs, no host sync (graph-safe)

            return triton_moe.fused_experts(x, self.w13, self.w2, weights, ids)
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.w13[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2[expert]) * flat_weights[pairs, None]
            out.index_add_(0, tokens, h)
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts, named as the checkpoint names them (`mlp.gate`, `mlp.experts`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                config.hidden_act)
        # Profiling sets this: every token goes to experts 0..k-1, the routing that puts the most tokens
        # through one expert, whatever the dummy tokens' own routing would be.
        self.force_worst_routing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, x.dtype)
        if self.force_worst_routing:
            ids = torch.arange(self.top_k, device=x.device).expand_as(ids)
        return self.experts(x, weights, ids)
