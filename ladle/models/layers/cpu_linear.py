"""Linear layers on CPU, laid out once after loading (DecoderForCausalLM.lay_out_for_cpu).

With ladle's C kernels (ladle.kernels.cpu_kernels), a CpuLinear runs the few rows of a decode step through
skinny_linear, which reads each weight row once at close to memory bandwidth, and larger inputs (prefill chunks)
through F.linear; the weight stays the checkpoint's own row-major tensor, so nothing is copied. Measured on one
thread, every linear of qwen3-512 once per step, weights streamed (benchmarks/results/cpu_linear.md): 4 rows
16.6 ms against 21.8 ms oneDNN-packed and 37.2 ms F.linear; bf16 9.1 ms against 35.4 ms F.linear (this CPU has
no bf16 matmul instructions, so torch's bf16 path is slow at every size, and the kernel takes bf16 inputs of any
size: 452 ms against 2,221 ms at 256 rows).

Without a C compiler, the weights are pre-packed for oneDNN instead, as vLLM's CPU backend runs them (its
onednn_mm): packing once at load time does the layout work F.linear's BLAS call repeats on every call (21.8
against 37.2 ms at 4 rows, same table). The head then also keeps a column-major copy, which one row reads as a
streaming GEMV (3.0 ms against 6.4 ms packed, when the fallback was the default path).
"""
from __future__ import annotations

import sys
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from ladle.kernels.cpu_kernels import CpuKernels
from ladle.quantization.fp8_linear import WidenBuffer

# fp32, every linear of qwen3-512 once (benchmarks/cpu_linear.py): at 16 rows skinny_linear takes 37 ms and
# F.linear 46, at 32 rows 74 and 68; the crossover lies between.
SKINNY_MAX_ROWS = 24


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] in oneDNN's blocked layout, or None where oneDNN cannot pack this dtype on this CPU
    (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except RuntimeError:
        return None


@runtime_checkable
class UsesCpuKernels(Protocol):
    """A layer with a C-kernel path of its own (the quantized layers, FusedMoE), handed the kernels on CPU."""

    def use_cpu_kernels(self, kernels: CpuKernels, native_bf16: bool, buffer: WidenBuffer | None = None) -> None: ...


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose weight lives only in packed form (the same values, so the same memory)."""

    packed_weight: torch.Tensor  # a registered buffer

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

    packed: torch.Tensor  # registered buffers
    column_major: torch.Tensor | None

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


class CpuLinear(nn.Module):
    """y = x W^T + b on CPU: skinny_linear for up to max_rows rows, F.linear above. The weight is the given
    tensor itself (a tied head passes the embedding's), registered as this module's parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: CpuKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.kernels = kernels
        # bf16 goes through the kernel at any size where oneDNN cannot pack it: torch's own path is slower.
        native_bf16 = weight.dtype != torch.bfloat16 or pack(weight[:16]) is not None
        self.max_rows = SKINNY_MAX_ROWS if native_bf16 else sys.maxsize

    def describe(self) -> str:
        rows = "any number of rows" if self.max_rows == sys.maxsize else f"up to {self.max_rows} rows"
        return f"linears through skinny_linear (C) for {rows}, F.linear above"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not 0 < rows <= self.max_rows or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        failed = self.kernels.skinny_linear(
            x2.data_ptr(), self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
            rows, self.out_features, self.in_features, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if failed:
            raise MemoryError(f"skinny_linear could not allocate {rows} x {self.in_features} floats")
        return y


def native_bf16_matmul() -> bool:
    """Whether torch's bf16 matmul is fast here: oneDNN can pack bf16 (AVX-512 BF16, AMX or AVX-NE-CONVERT)."""
    return pack(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None


def use_cpu_linears(root: nn.Module, kernels: CpuKernels) -> int:
    """Replace every nn.Linear under root by a CpuLinear over the same weight; returns how many."""
    replaced = 0
    native_bf16, buffer = native_bf16_matmul(), WidenBuffer()
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(parent, name, CpuLinear(child.weight, child.bias, kernels))
                replaced += 1
            elif isinstance(child, UsesCpuKernels):  # a quantized layer (ladle.quantization): one shared buffer
                child.use_cpu_kernels(kernels, native_bf16, buffer)
    return replaced
