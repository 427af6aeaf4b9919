"""A linear layer whose weight stays in a GGUF file's block format in memory: Q8_0, Q4_0, Q4_1, or the K-quants
Q4_K, Q5_K and Q6_K (the types most published GGUF files use).

The parameter `weight` is the file's bytes, [out, in / block weights * block bytes] uint8 (rows in HF's order:
the loader un-permutes llama's Q/K rows as whole block rows), so SmolLM2's Q4_1 linears take 0.625 bytes a
weight where fp32 takes 4, and Q4_K ones 0.5625. A block is 32 weights, a K-quant super-block 256, so a K-quant
layer needs in_features a multiple of 256 (use_ggml_linears widens one that is not). On CPU, decode rows go
through ladle's ggml_linear C kernel (ladle/kernels/cpu/ggml_linear.c), which reads the blocks directly and
keeps x in fp32 (llama.cpp rounds activations to 8 bits; ladle never does); a prefill's rows widen
TILE_ELEMENTS weights (whole rows) at a time into the model dtype, in C, with exactly the values gguf's
dequantize gives, and multiply them by F.linear, so the workspace is one tile (shared by the model's quantized
layers), never the layer. Without the C kernels the same widening runs in torch. A stacked layer (q/k/v,
gate/up) holds its parts' rows one after another; every part must be in the same block type (the loader widens
the layer otherwise).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ladle.quantization.fp8_linear import KERNEL_MAX_ROWS, TILE_ELEMENTS, WidenBuffer
from ladle.quantization.layer_interfaces import KeepsDtypes, StackedProjections, View, narrow_rows

if TYPE_CHECKING:
    from ladle.kernels.cpu_kernels import CpuKernels

# ggml type name -> (ggml type id, bytes per block): ggml's block_q8_0, block_q4_0, block_q4_1 (32 weights) and
# block_q4_K, block_q5_K, block_q6_K (256-weight super-blocks).
BLOCK_TYPES: dict[str, tuple[int, int]] = {"Q8_0": (8, 34), "Q4_0": (2, 18), "Q4_1": (3, 20),
                                           "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def block_weights(qtype: str) -> int:
    """Weights per block of qtype: 256 in a K-quant super-block, 32 in the others."""
    return 256 if qtype in K_QUANTS else 32


def row_bytes(in_features: int, qtype: str) -> int:
    return in_features // block_weights(qtype) * BLOCK_TYPES[qtype][1]


def torch_dequantize(blocks: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """blocks [R, row bytes] uint8 -> [R, in] in dtype, each weight computed as gguf's dequantize does (d * q,
    d * (q - 8), d * q + m, (d * sc) * q - dmin * mn, (d * scale) * (q - 32), in fp32): the path without
    ladle's C kernels, and the tests' reference."""
    size = BLOCK_TYPES[qtype][1]
    b = blocks.reshape(blocks.shape[0], -1, size)
    if qtype in K_QUANTS:
        values = _k_dequantize(b, qtype)
    else:
        d = _half(b[..., 0:2])
        if qtype == "Q8_0":
            values = d * b[..., 2:].contiguous().view(torch.int8).float()
        else:
            nib = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
            q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()  # byte j: weight j low, weight j + 16 high
            values = d * q + _half(b[..., 2:4]) if qtype == "Q4_1" else d * (q - 8)
    return values.reshape(blocks.shape[0], -1).to(dtype)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (a little-endian fp16) -> [..., 1] fp32."""
    return two_bytes.contiguous().view(torch.float16).float()


def _k_dequantize(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """K-quant super-blocks [R, n, size] uint8 -> [R, n, 256] fp32, as gguf.quants' Q4_K / Q5_K / Q6_K."""
    lead = b.shape[:2]
    if qtype == "Q6_K":
        # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16 weights), fp16 d
        ql = b[..., :128].reshape(*lead, 2, 1, 64)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=-2)  # weight 128h + 64s + i: nibble s of ql[64h + i]
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
        high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2)  # 128h + 32t + i: qh[32h + i]
        q = (low.reshape(*lead, 256).int() | (high.reshape(*lead, 256).int() << 4)) - 32
        scale = _half(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
        return (scale.unsqueeze(-1) * q.reshape(*lead, 16, 16).float()).reshape(*lead, 256)
    # fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins (one each per 32 weights), [Q5_K: 32 bytes of
    # fifth bits,] 128 bytes of nibbles
    sc = b[..., 4:16].int()
    scales = torch.cat([sc[..., 0:4] & 63, (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], dim=-1)
    start = 16 if qtype == "Q4_K" else 48
    qs = b[..., start:start + 128].reshape(*lead, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*lead, 8, 32).int()  # sub-block 2c + s: nibble s
    if qtype == "Q5_K":
        qh = b[..., 16:48].reshape(*lead, 1, 32).int()
        q = q | (torch.cat([(qh >> bit) & 1 for bit in range(8)], dim=-2) << 4)  # bit s of qh[i]: sub-block s
    d = (_half(b[..., 0:2]) * scales.float()).unsqueeze(-1)
    dm = (_half(b[..., 2:4]) * mins.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(*lead, 256)


class GgmlLinear(nn.Module, StackedProjections, KeepsDtypes):
    keep_dtypes = ("weight",)  # the loader's cast to the model dtype leaves the block bytes alone

    def __init__(self, in_features: int, out_features: int, bias: bool, qtype: str,
                 shards: dict[str, tuple[int, int]] | None = None) -> None:
        """qtype: a BLOCK_TYPES name; shards: for a stacked layer, checkpoint module name -> (first row, rows)."""
        super().__init__()
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"GgmlLinear takes {', '.join(BLOCK_TYPES)} blocks, got {qtype}")
        if in_features % block_weights(qtype):
            raise ValueError(f"GgmlLinear takes rows of whole {block_weights(qtype)}-weight {qtype} blocks, got "
                             f"{in_features} inputs")
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = nn.Parameter(torch.empty(out_features, row_bytes(in_features, qtype), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shards = shards or {}
        self.kernels: CpuKernels | None = None  # set by use_cpu_kernels
        self.buffer = WidenBuffer()  # the model's shared one, from use_cpu_kernels
        self.skinny_bf16 = False  # torch's bf16 matmul is slow here: bf16 prefill tiles go through skinny_linear

    def checkpoint_views(self, prefix: str) -> dict[str, tuple[str, View]]:
        parent = prefix.rsplit(".", 1)[0]
        views: dict[str, tuple[str, View]] = {}
        for shard, (start, size) in self.shards.items():
            views[f"{parent}.{shard}.weight"] = (f"{prefix}.weight", narrow_rows(start, size))
            if self.bias is not None:
                views[f"{parent}.{shard}.bias"] = (f"{prefix}.bias", narrow_rows(start, size))
        return views

    def use_cpu_kernels(self, kernels: CpuKernels, native_bf16: bool, buffer: WidenBuffer | None = None) -> None:
        """native_bf16: torch's bf16 matmul is fast here; where it is not (AVX2), a bf16 prefill multiplies
        each widened tile by skinny_linear, as Fp8Linear and bf16 CpuLinear weights do."""
        self.kernels = kernels
        self.buffer = buffer or self.buffer
        self.skinny_bf16 = not native_bf16

    def dequantized(self, start: int, stop: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of the weight in dtype (into out when given, with the C kernels)."""
        if self.kernels is None or dtype not in _KERNEL_DTYPES:
            return torch_dequantize(self.weight[start:stop], self.qtype, dtype)
        out = torch.empty(stop - start, self.in_features, dtype=dtype) if out is None else out
        self.kernels.ggml_dequantize(self.weight[start:stop].data_ptr(), out.data_ptr(), stop - start,
                                     self.in_features, BLOCK_TYPES[self.qtype][0], int(dtype == torch.bfloat16),
                                     torch.get_num_threads())
        return out

    def _kernel(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        x2 = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype).contiguous()
        assert self.kernels is not None  # called only with the C kernels loaded
        failed = self.kernels.ggml_linear(x2.data_ptr(), self.weight.data_ptr(),
                                          None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                                          self.out_features, self.in_features, BLOCK_TYPES[self.qtype][0],
                                          int(x.dtype == torch.bfloat16), torch.get_num_threads())
        if failed:
            raise MemoryError(f"ggml_linear could not allocate {rows} x {self.in_features} floats")
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernels is not None and 0 < rows <= KERNEL_MAX_ROWS and x.dtype in _KERNEL_DTYPES:
            return self._kernel(x, rows)
        tile = max(1, TILE_ELEMENTS // self.in_features)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, tile):
            stop = min(start + tile, self.out_features)
            scratch = self.buffer.take((stop - start, self.in_features), x.dtype) if self.kernels is not None else None
            weight = self.dequantized(start, stop, x.dtype, scratch)
            bias = None if self.bias is None else self.bias[start:stop].to(x.dtype)
            if self.skinny_bf16 and x.dtype == torch.bfloat16 and self.kernels is not None:
                out[..., start:stop] = self._skinny(x, weight, bias)
            else:
                out[..., start:stop] = F.linear(x, weight, bias)
        return out

    def _skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        bias = None if bias is None else bias.contiguous()
        assert self.kernels is not None  # called only with the C kernels loaded
        failed = self.kernels.skinny_linear(x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                            y.data_ptr(), rows, weight.shape[0], self.in_features, 1,
                                            torch.get_num_threads())
        if failed:
            raise MemoryError(f"skinny_linear could not allocate {rows} x {self.in_features} floats")
        return y.view(*x.shape[:-1], weight.shape[0])


def use_ggml_linears(root: nn.Module, types: dict[str, str]) -> set[str]:
    """Replace each nn.Linear under root (on meta) whose checkpoint weights are all in one block type of
    BLOCK_TYPES (types: HF weight name -> ggml type name) by a GgmlLinear; returns the checkpoint weight names
    now kept as blocks (the loader reads those raw). A layer whose parts differ in type (a Q4_K_M file's Q6_K
    attn_v beside Q4_K q and k), or whose inputs are not whole blocks of its type, stays a widened linear."""
    kept: set[str] = set()
    for prefix, parent in list(root.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{prefix}.{name}" if prefix else name
            shards = child.shards if isinstance(child, StackedProjections) else None
            parts = ([f"{full.rsplit('.', 1)[0]}.{shard}.weight" for shard in shards] if shards
                     else [f"{full}.weight"])
            found = {types.get(p) for p in parts}
            if (len(found) != 1 or (qtype := found.pop()) not in BLOCK_TYPES
                    or child.in_features % block_weights(qtype)):
                continue
            setattr(parent, name, GgmlLinear(child.in_features, child.out_features, child.bias is not None, qtype,
                                             dict(shards) if shards else None))
            kept.update(parts)
    return kept
