"""MXFP4 weights as DeepSeek-V4's routed experts ship them: e2m1 values two a byte (the low nibble first) in an
int8 tensor [out, in / 2], and one E8M0 power-of-two scale per 32 inputs [out, in / 32]. They stay packed in
memory (an eighth of fp32's bytes, plus a byte per 32 values); an expert is widened when a step routes to it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ladle.quantization.config import MXFP4_GROUP
from ladle.quantization.fp8_linear import KERNEL_MAX_ROWS, WidenBuffer
from ladle.quantization.layer_interfaces import ExpertStack

if TYPE_CHECKING:
    from ladle.kernels.cpu_kernels import CpuKernels

# e2m1: sign, two exponent bits, one mantissa bit; code c's value, the sign bit (8) negating it.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., R, C / 2] (int8) and scales [..., R, C / 32] (E8M0) -> [..., R, C] in dtype, each value
    times its group's scale in fp32 first (HF's order, so fp32 results match it)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.view(torch.uint8)
    values = torch.stack([lut[(u8 & 15).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)
    grouped = values.unflatten(-1, (-1, MXFP4_GROUP)) * scales.float().unsqueeze(-1)
    return grouped.flatten(-2).to(dtype)


class Mxfp4ExpertStack(ExpertStack):
    """Stacked experts' packed weights [E, R, C / 2] and scales [E, R, C / 32], indexed like the dequantized
    stack [E, R, C]: stack[e] is expert e's weight in dtype, made when asked. With ladle's C kernels (CPU),
    linear() multiplies a decode step's few rows by the packed bytes directly (ladle/kernels/cpu/mxfp4_linear.c)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 kernels: CpuKernels | None = None, buffer: WidenBuffer | None = None) -> None:
        self.packed, self.scales, self.dtype, self.kernels, self.buffer = packed, scales, dtype, kernels, buffer
        self.shape = (*packed.shape[:-1], 2 * packed.shape[-1])

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_mxfp4(self.packed[expert], self.scales[expert], self.dtype)

    def widened(self, expert: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Expert's weight in dtype (fp32 or bf16) widened in C, into out when given: the same bits as stack[e]."""
        out = torch.empty(self.shape[1:], dtype=dtype) if out is None else out
        assert self.kernels is not None  # called only with the C kernels loaded
        self.kernels.mxfp4_dequantize(self.packed[expert].data_ptr(), self.scales[expert].data_ptr(), out.data_ptr(),
                                      self.shape[1], self.shape[2], int(dtype == torch.bfloat16),
                                      torch.get_num_threads())
        return out

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, C] @ expert's weight^T -> [T, R]: a decode step's rows by the packed bytes, a prefill's by the
        expert widened once into the shared buffer."""
        rows = x.shape[0]
        if self.kernels is None or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x, self[expert])
        if rows > KERNEL_MAX_ROWS:
            out = None if self.buffer is None else self.buffer.take(tuple(self.shape[1:]), x.dtype)
            return F.linear(x, self.widened(expert, x.dtype, out))
        x = x.contiguous()
        y = torch.empty(rows, self.shape[1], dtype=x.dtype)
        failed = self.kernels.mxfp4_linear(x.data_ptr(), self.packed[expert].data_ptr(),
                                           self.scales[expert].data_ptr(), y.data_ptr(), rows, self.shape[1],
                                           self.shape[2], int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if failed:
            raise MemoryError(f"mxfp4_linear could not allocate {rows} x {self.shape[2]} floats")
        return y
