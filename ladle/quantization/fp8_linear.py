"""A linear layer whose weight stays block-scaled FP8 in memory (e4m3 values, one fp32 scale per block).

The checkpoint's own tensors are the parameters: `weight` [out, in] in float8_e4m3fn and `weight_scale_inv`
[ceil(out / rows), ceil(in / cols)] in fp32 (or E8M0), so the weights take a quarter of fp32's bytes. On CPU,
decode rows go through ladle's fp8_linear C kernel, which reads the FP8 bytes directly
(ladle/kernels/cpu/fp8_linear.c); on CUDA, a Triton GEMM widens them in its inner loop
(ladle/kernels/triton_quant.py). A prefill's rows widen TILE_ELEMENTS weights (whole rows) at a time into the
model dtype (value x its block's scale, in fp32, then the model dtype, as HF's dequantize does; in C on CPU)
and multiply them by F.linear, or by skinny_linear where torch's bf16 matmul is slow, so the workspace is one
tile, never the layer or the model. A stacked layer
(q/k/v, gate/up) fills its rows and its scale grid's rows from the checkpoint's parts; a part must start on the
block grid, or its scales would cover two parts.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ladle.quantization.layer_interfaces import ExpertStack, KeepsDtypes, StackedProjections, View, narrow_rows

if TYPE_CHECKING:
    from ladle.kernels.cpu_kernels import CpuKernels

TILE_ELEMENTS = 1 << 21  # weights widened at once (a whole number of block rows): 8 MiB of fp32 workspace
KERNEL_MAX_ROWS = 24  # up to this many input rows, ladle's C kernel reads the FP8 bytes directly (CPU)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class WidenBuffer:
    """The one workspace a model's quantized layers widen their weight tiles into on CPU: a step widens one tile
    at a time and multiplies it before the next, so every layer shares it; it grows to the largest tile once."""

    def __init__(self) -> None:
        self.storage = torch.empty(0, dtype=torch.uint8)

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Scratch of shape and dtype, valid until the next take."""
        size = shape[0] * shape[1] * dtype.itemsize
        if self.storage.numel() < size:
            self.storage = torch.empty(size, dtype=torch.uint8)
        return self.storage[:size].view(dtype).view(shape)


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], first_row: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """values [R, C] (e4m3, starting at row first_row of a weight whose scale grid starts at scales' row 0)
    times each entry's block scale (fp32 or E8M0), in fp32, then dtype."""
    rows, cols = block
    r, skip = values.shape[0], first_row % rows
    grid = scales[first_row // rows : -(-(first_row + r) // rows)].float()
    grid = grid.repeat_interleave(rows, 0)[skip : skip + r].repeat_interleave(cols, 1)[:, : values.shape[1]]
    return (values.float() * grid).to(dtype)


class Fp8ExpertStack(ExpertStack):
    """Stacked experts' FP8 weights [E, R, C] and scales [E, R / rows, C / cols], indexed like the dequantized
    stack: stack[e] is expert e's weight in dtype, made when asked, so a step holds one expert's at a time. With
    ladle's C kernels (CPU), linear() multiplies a decode step's few rows by the FP8 bytes directly, and a
    prefill's rows by the expert widened once into the shared buffer."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                 kernels: CpuKernels | None = None, buffer: WidenBuffer | None = None) -> None:
        self.values, self.scales, self.block, self.dtype = values, scales, block, dtype
        self.kernels, self.buffer = kernels, buffer
        self.shape = values.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_blocks(self.values[expert], self.scales[expert], self.block, 0, self.dtype)

    def linear(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [T, C] @ expert's weight^T -> [T, R]."""
        rows = x.shape[0]
        if self.kernels is None or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x, self[expert])
        if rows <= KERNEL_MAX_ROWS:
            return fp8_kernel_linear(self.kernels, x, self.values[expert], self.scales[expert], self.block, None)
        out = None if self.buffer is None else self.buffer.take((self.shape[1], self.shape[2]), x.dtype)
        return F.linear(x, c_dequantized(self.kernels, self.values[expert], self.scales[expert], self.block, x.dtype,
                                         out))


def c_dequantized(kernels: CpuKernels, values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """values [R, C] (e4m3, a weight's rows from a block's first) times their block scales, widened in C (into
    out when given)."""
    out = torch.empty(values.shape, dtype=dtype) if out is None else out
    scales = scales.float().contiguous()
    kernels.fp8_dequantize(values.contiguous().data_ptr(), scales.data_ptr(), out.data_ptr(), values.shape[0],
                           values.shape[1], block[0], block[1], int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def fp8_kernel_linear(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias) by ladle's fp8_linear C kernel, in x's dtype (fp32 or bf16)."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(rows, in_features).contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    if scales.dtype != torch.float32 or not scales.is_contiguous():
        scales = scales.float().contiguous()  # E8M0 widened: the grid is 1/16384th of the weight
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    failed = kernels.fp8_linear(x2.data_ptr(), weight.data_ptr(), scales.data_ptr(),
                                None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                                out_features, in_features, block[0], block[1], x.dtype == torch.bfloat16,
                                torch.get_num_threads())
    if failed:
        raise MemoryError(f"fp8_linear could not allocate {rows} x {in_features} floats")
    return y


class Fp8Linear(nn.Module, StackedProjections, KeepsDtypes):
    keep_dtypes = ("weight", "weight_scale_inv")  # the loader's cast to the model dtype leaves these

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int],
                 shards: dict[str, tuple[int, int]] | None = None, scale_dtype: torch.dtype = torch.float32) -> None:
        """shards: for a stacked layer, checkpoint module name -> (first row, rows), in output order;
        scale_dtype: the checkpoint's (fp32, or float8_e8m0fnu as DeepSeek-V4 ships them)."""
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        rows, cols = block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-out_features // rows), -(-in_features // cols),
                                                         dtype=scale_dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.kernels: CpuKernels | None = None  # set by use_cpu_kernels
        self.buffer = WidenBuffer()  # the model's shared one, from use_cpu_kernels
        self.bf16_max_rows = KERNEL_MAX_ROWS
        for name, (start, _) in self.shards.items():
            if start % rows:
                raise ValueError(f"{name} starts at row {start} of a stacked FP8 layer, off the {rows}-row block "
                                 "grid, so a scale block would cover two projections")

    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, View]]:
        parent, rows = prefix.rsplit(".", 1)[0], self.block[0]
        views: dict[str, tuple[str, View]] = {}
        for shard, (start, size) in self.shards.items():
            views[f"{parent}.{shard}.weight"] = (f"{prefix}.weight", narrow_rows(start, size))
            views[f"{parent}.{shard}.weight_scale_inv"] = (
                f"{prefix}.weight_scale_inv", narrow_rows(start // rows, -(-size // rows)))
            if self.bias is not None:
                views[f"{parent}.{shard}.bias"] = (f"{prefix}.bias", narrow_rows(start, size))
        return views

    def dequantized(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the weight in dtype (ladle's C widening on CPU when the rows start a block)."""
        return self._widened(start, stop, dtype, None)

    def _widened(self, start: int, stop: int, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
        if self.kernels is not None and dtype in (torch.float32, torch.bfloat16) and start % self.block[0] == 0:
            return c_dequantized(self.kernels, self.weight[start:stop], self.weight_scale_inv[start // self.block[0]:],
                                 self.block, dtype, out)
        return dequantize_blocks(self.weight[start:stop], self.weight_scale_inv, self.block, start, dtype)

    def _tile(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) widened for one product: into the shared buffer where the C kernels widen."""
        out = self.buffer.take((stop - start, self.in_features), dtype) if self.kernels is not None else None
        return self._widened(start, stop, dtype, out)

    def use_cpu_kernels(self, kernels: CpuKernels, native_bf16: bool, buffer: WidenBuffer | None = None) -> None:
        """native_bf16: torch's bf16 matmul is fast here; where it is not, bf16 inputs of any size take the
        kernel, as CpuLinear's bf16 weights do (measured: a 1K-token bf16 prefill 1.44x slower through F.linear)."""
        self.kernels = kernels
        self.buffer = buffer or self.buffer
        self.bf16_max_rows = KERNEL_MAX_ROWS if native_bf16 else sys.maxsize

    def _tile_rows(self) -> int:
        rows = self.block[0]
        return max(rows, TILE_ELEMENTS // self.in_features // rows * rows)

    def _widened_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """A prefill's many bf16 rows where torch's bf16 matmul is slow: each tile of weight rows widened to
        bf16 once, then multiplied by skinny_linear as a bf16 layer's weights are, so the widening is paid once
        per forward, not once per 4 rows as in fp8_linear (measured: a 1K prefill 1.35x bf16's time that way)."""
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        tile = self._tile_rows()
        assert self.kernels is not None  # called only with the C kernels loaded
        for start in range(0, self.out_features, tile):
            stop = min(start + tile, self.out_features)
            weight = self._tile(start, stop, x.dtype)
            bias = None if self.bias is None else self.bias[start:stop].to(x.dtype).contiguous()
            y = out if stop - start == self.out_features else torch.empty(rows, stop - start, dtype=x.dtype)
            failed = self.kernels.skinny_linear(x2.data_ptr(), weight.data_ptr(),
                                                None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                                                stop - start, self.in_features, 1, torch.get_num_threads())
            if failed:
                raise MemoryError(f"skinny_linear could not allocate {rows} x {self.in_features} floats")
            if y is not out:
                out[:, start:stop] = y
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernels is not None and 0 < rows <= KERNEL_MAX_ROWS and x.dtype in _KERNEL_DTYPES:
            return fp8_kernel_linear(self.kernels, x, self.weight, self.weight_scale_inv, self.block, self.bias)
        limit = {torch.float32: KERNEL_MAX_ROWS, torch.bfloat16: self.bf16_max_rows}.get(x.dtype, 0)
        if self.kernels is not None and 0 < rows <= limit:
            return self._widened_tiles(x)
        if x.is_cuda:  # widened inside a Triton GEMM's inner loop
            from ladle.kernels.triton_quant import fp8_linear

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        tile = self._tile_rows()
        if self.out_features <= tile:
            return F.linear(x, self._tile(0, self.out_features, x.dtype), self.bias)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, tile):
            stop = min(start + tile, self.out_features)
            bias = None if self.bias is None else self.bias[start:stop]
            out[..., start:stop] = F.linear(x, self._tile(start, stop, x.dtype), bias)
        return out
