"""Qwen4-Exp's norms: zero-centred RMSNorm over groups of a row (one group per hyper-connection stream), and the
gated RMSNorm of its Gated DeltaNet output with the activation the config names (output_gate_type)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.layers.gated_deltanet import GatedRMSNorm

GATE_ACTIVATIONS = ("silu", "sigmoid")


class GroupedRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in fp32, the rms taken over each group of `group` features (HF's Qwen4ExpTextRMSNorm
    with group_size; group = dim: one group, the usual zero-centred norm)."""

    def __init__(self, dim: int, eps: float, group: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.group = eps, group or dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().unflatten(-1, (-1, self.group))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


class ActivationGatedRMSNorm(GatedRMSNorm):
    """RMSNorm of each head's output times act(gate) (HF's Qwen4ExpTextRMSNormGated): act is silu or sigmoid."""

    def __init__(self, dim: int, eps: float, activation: str) -> None:
        super().__init__(dim, eps)
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"output_gate_type {activation!r} is not supported; supported: {GATE_ACTIVATIONS}")
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        act = F.silu if self.activation == "silu" else torch.sigmoid
        return ((self.weight * h.to(dtype)) * act(gate.float())).to(dtype)
