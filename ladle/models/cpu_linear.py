"""Linear layers on CPU with weights pre-packed for oneDNN, as vLLM's CPU backend runs them (its onednn_mm).

F.linear with a row-major weight is slow for the few rows of a decode step (the BLAS call lays the weight out
for its kernel on every call; packing once at load time does that work once). Measured here on one thread, fp32,
8 rows (benchmarks/cpu_linear.py): 512 -> 3072 takes 0.45 ms packed against 0.74 ms, and the 512 -> 32000 head
10.3 ms against 18.9 ms; a whole qwen3-512 step's linears at 4 rows, weights streamed from memory, 22 ms against
38 ms; long prefills take about the same either way. One row is the exception for a wide head: read
column-major it is a streaming GEMV (3.0 ms against 6.4 ms packed), so the head keeps that layout too and picks
by row count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] in oneDNN's blocked layout, or None where oneDNN cannot pack this dtype on this CPU
    (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives only in packed form (the same values, so the same memory)."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)


def pack_linears(root: nn.Module) -> int:
    """Replace every nn.Linear under root (fused ones included) by a PackedLinear; returns how many. Only for
    modules that use their linears by calling them: one that reads a linear's .weight directly would lose it."""
    replaced = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                packed = pack(child.weight)
                if packed is None:
                    return replaced
                setattr(parent, name, PackedLinear(child, packed))
                replaced += 1
    return replaced


class CpuHead(nn.Module):
    """The LM head on CPU: column-major for one row (a streaming GEMV), packed for more."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        # bf16 read column-major is 6-11x slower than row-major here, so only fp32 keeps that layout.
        column_major = weight.detach().t().contiguous().t() if weight.dtype == torch.float32 else None
        self.register_buffer("column_major", column_major)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1 and self.column_major is not None:
            return F.linear(hidden, self.column_major)
        return packed_linear(hidden, self.packed, None)
