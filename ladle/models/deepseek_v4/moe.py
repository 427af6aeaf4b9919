"""DeepSeek-V4's MoE layer: routed experts chosen by score (sqrtsoftplus + a correction bias) or by the frozen
token-id hash table of a hash layer, and one shared expert, all SwiGLU clamped at swiglu_limit."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.interface import RoutedExperts
from ladle.models.layers.moe import FusedMoE


class ClampedMLP(nn.Module):
    """The shared expert: SwiGLU with the gate clamped above and the up projection clamped both ways."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        return self.w2(F.silu(gate) * self.w3(x).clamp(min=-self.limit, max=self.limit))


class Gate(nn.Module):
    """The router: sqrtsoftplus (or softmax / sigmoid) scores; the experts come from top-k of score + bias,
    or from the frozen tid2eid table of a hash layer; their scores, renormalised, times routed_scaling_factor."""

    tid2eid: torch.Tensor  # a registered buffer, on hash layers only

    def __init__(self, config: Any, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.scoring = config.scoring_func
        if self.scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring!r} is not supported; supported: sqrtsoftplus, softmax, "
                             "sigmoid")
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.hashed = hashed
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts))  # e_score_correction_bias

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(RoutedExperts):
    def __init__(self, config: Any, hashed: bool) -> None:
        super().__init__()
        self.gate = Gate(config, hashed)
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                config.hidden_act, ("w1", "w3", "w2"), config.swiglu_limit)
        self.shared_experts = ClampedMLP(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        if self.force_worst_routing:
            ids = torch.arange(ids.shape[1], device=x.device).expand_as(ids)
        return self.experts(x, weights.to(x.dtype), ids) + self.shared_experts(x)
