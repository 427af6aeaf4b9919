"""CUDA: the experts of a mixture-of-experts layer as two grouped GEMMs over expert-sorted token blocks (the
fused_moe_kernel of vLLM and SGLang, with moe_align_block_size).

Each (token, slot) pair routed to expert e is placed in e's run of a sorted list padded to a multiple of
BLOCK_M, so every block of BLOCK_M rows belongs to one expert and one program multiplies it by that expert's
weights. The alignment is computed on the device with a fixed upper bound on its length, so nothing waits on
the host and a decode step can be captured in a CUDA graph. The GEMMs write one row per pair; the k rows of a
token are summed at the end, each already scaled by its routing weight.

CPU tensors mean Triton's interpreter is running (TRITON_INTERPRET=1, for tests without a GPU).
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ladle.kernels import triton_ops
from ladle.kernels.triton_quant import e2m1_to_f32, e4m3_to_f32


def moe_align_block_size(ids: torch.Tensor, block_m: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted pair indices [P], expert of each block [P / block_m]), P the longest the padding can
    be (T*k + E*(block_m - 1), rounded up to block_m). Padding rows hold T*k (masked off); blocks past the
    last expert's run have expert -1 (skipped)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    # scatter_add rather than bincount, which reads the largest id back to the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded  # each expert's first row in the sorted list
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    length = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((length,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[start[flat[order]] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, length, block_m, device=ids.device)
    expert = torch.searchsorted(torch.cumsum(padded, 0), block_starts, right=True)
    expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return sorted_ids, expert


@triton.jit
def _grouped_gemm_kernel(
    a, b, s, c, weights, sorted_ids, expert_ids,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_cm,
    ROWS_PER_A: tl.constexpr, SCALE: tl.constexpr, FORMAT: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair, :N] = a[pair // ROWS_PER_A, :K] @ b[expert, :N, :K].T (times weights[pair] when SCALE), for the
    BLOCK_M pairs of block program_id(0), columns program_id(1). FORMAT 0: b dense; 1: e4m3 bytes with one
    fp32 scale s[expert, n // SCALE_N, k // SCALE_K] a block; 2: MXFP4, b [E, N, K / 2] packed, s the E8M0
    bytes [E, N, K / 32] (ladle.kernels.triton_quant)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids + rows).to(tl.int64)
    valid = pair < num_pairs
    a_row = pair // ROWS_PER_A
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(a + a_row[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        if FORMAT == 0:
            w = tl.load(b + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=w_ok,
                        other=0.0).to(tl.float32)
        elif FORMAT == 1:
            w = e4m3_to_f32(tl.load(b + expert * stride_be + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
                                    mask=w_ok, other=0).to(tl.int32))
            w *= tl.load(s + expert * stride_se + (cols // SCALE_N) * stride_sn + k0 // SCALE_K, mask=col_ok,
                         other=0.0)[None, :]
        else:
            byte = tl.load(b + expert * stride_be + cols[None, :] * stride_bn + (ks // 2)[:, None] * stride_bk,
                           mask=w_ok, other=0).to(tl.int32) & 0xFF
            code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
            exponent = tl.load(s + expert * stride_se + cols[None, :] * stride_sn + (ks // 32)[:, None], mask=w_ok,
                               other=127).to(tl.int32) & 0xFF
            w = e2m1_to_f32(code) * tl.exp2((exponent - 127).to(tl.float32))
        acc += tl.dot(x.to(tl.float32), w)
    if SCALE:
        acc *= tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c + pair[:, None] * stride_cm + cols[None, :], acc.to(c.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def _operands(w: Any) -> tuple[torch.Tensor, torch.Tensor | None, int, tuple[int, int], int]:
    """(weight bytes, scales, FORMAT, scale block, K) of a dense stack or a quantized one (ladle.quantization's
    Mxfp4ExpertStack has packed bytes, Fp8ExpertStack e4m3 values and a scale block)."""
    if hasattr(w, "packed"):
        return w.packed, w.scales.view(torch.uint8), 2, (1, 32), w.shape[2]
    if hasattr(w, "block"):
        return w.values.view(torch.uint8), w.scales.float(), 1, w.block, w.shape[2]
    return w, None, 0, (1, 1), w.shape[2]


def _grouped_gemm(a: torch.Tensor, w: Any, out: torch.Tensor, weights: torch.Tensor,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, rows_per_a: int, scale: bool,
                  block_m: int) -> None:
    b, s, fmt, block, k = _operands(w)
    n = b.shape[1]
    # tl.dot needs every tile side >= 16 on a GPU; an FP8 K tile must not straddle two scale blocks.
    block_n, block_k = min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))
    if fmt == 1 and block[1] % block_k:
        raise ValueError(f"FP8 experts' scale blocks are {block[1]} columns wide; the Triton kernel needs a "
                         f"multiple of {block_k}")
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    s = b if s is None else s.contiguous()
    _grouped_gemm_kernel[grid](
        a, b, s, out, weights, sorted_ids, expert_ids, out.shape[0], n, k,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), s.stride(0), s.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, SCALE=scale, FORMAT=fmt, SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(x: torch.Tensor, w13: Any, w2: Any, weights: torch.Tensor, ids: torch.Tensor,
                  block_m: int = 16, swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (dense, or FP8 / MXFP4 stacks widened in the kernel), routing
    weights and ids [T, k] -> [T, H]. swiglu_limit (DeepSeek-V4) clamps the gate from above and the up
    projection both ways before the activation."""
    tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    sorted_ids, expert_ids = moe_align_block_size(ids, block_m, num_experts)
    pairs = tokens * top_k
    gate_up = torch.empty(pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    _grouped_gemm(x.contiguous(), w13, gate_up, flat_weights, sorted_ids, expert_ids, top_k, False, block_m)
    if swiglu_limit is not None:
        inter = w13.shape[1] // 2
        gate_up[:, :inter].clamp_(max=swiglu_limit)
        gate_up[:, inter:].clamp_(min=-swiglu_limit, max=swiglu_limit)
    hidden = triton_ops.silu_and_mul(gate_up)
    down = torch.empty(pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, w2, down, flat_weights, sorted_ids, expert_ids, 1, True, block_m)
    return down.view(tokens, top_k, -1).sum(dim=1)
