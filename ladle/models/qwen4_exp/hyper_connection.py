"""Qwen4-Exp's hyper-connections (HF's Qwen4ExpTextGatedResidual): the residual is hc_count streams of
hidden_size side by side, [T, hc_count * hidden]. Before each mixer (attention or MLP) the streams are normed per
stream, mixed into the mixer's input by a low-rank sigmoid gate, and the mixer's output is injected back into
every stream with its own weight; after the last layer a mixer without injection gives the head's input."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.qwen4_exp.norms import GroupedRMSNorm


class GatedResidual(nn.Module):
    def __init__(self, config: Any, inject: bool = True) -> None:
        super().__init__()
        self.n, self.hidden = config.hc_count, config.hidden_size
        width = self.n * self.hidden
        self.hc_norm = GroupedRMSNorm(width, config.rms_norm_eps, self.hidden)
        self.input_mix_weight_down = nn.Linear(width, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(config.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.n, bias=False) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, n * H] -> (the mixer's input [T, H], each stream's injection weight [T, n], or None for
        the final mixer)."""
        normed = self.hc_norm(streams)
        w = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.n)))
        mixed = (w.unflatten(-1, (self.n, self.hidden)) * normed.unflatten(-1, (self.n, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.n)

    @staticmethod
    def inject(streams: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """streams [T, n * H] plus the mixer's output out [T, H] weighted per stream by weights [T, n]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
