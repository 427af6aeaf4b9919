"""CUDA: weights kept in the release formats, widened inside the GEMM's inner loop (weight-only: activations
stay in the model dtype, accumulation in fp32).

- e4m3 bytes widen by bits (the 7 magnitude bits into fp32's exponent and mantissa, times 2^120, exact for
  normal and subnormal values), as ladle's CPU kernel does; each tile's values times its block's scale.
- MXFP4 nibbles (two a byte, the even input low) widen by their fields: sign, 2 exponent bits, 1 mantissa bit;
  each group of 32 inputs times 2^(E8M0 byte - 127).

Both are plain integer and float operations, so the same kernels run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, the tests) and compile for sm_90.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_to_f32(b):
    """uint8 e4m3 bytes (as int32) -> fp32 values."""
    bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120


@triton.jit
def e2m1_to_f32(code):
    """4-bit e2m1 codes (as int32) -> fp32 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_linear_kernel(x, w, s, bias, y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] * w[n, k] * s[n // SCALE_N, k // SCALE_K] (+ bias[n])."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0).to(tl.int32)
        scale = tl.load(s + (cols // SCALE_N) * stride_sn + k0 // SCALE_K, mask=col_ok, other=0.0)
        acc += tl.dot(a.to(tl.float32), e4m3_to_f32(b) * scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] in e4m3, scales [ceil(N / rows), ceil(K / cols)]) ^T -> [..., N] in x's dtype.
    BLOCK_K divides the scale block's columns, so a K tile never straddles two scales."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(64, block[1]) if block[1] % 16 == 0 else 16
    if block[1] % block_k:
        raise ValueError(f"the Triton FP8 kernel needs scale blocks {block[1]} columns wide to be a multiple of 16")
    block_m, block_n = (16 if m <= 16 else 64), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_linear_kernel[grid](x2, weight.view(torch.uint8), scales.float().contiguous(),
                             x2 if bias is None else bias, y, m, n, k, x2.stride(0), weight.stride(0),
                             scales.shape[1], y.stride(0), SCALE_N=block[0], SCALE_K=block[1],
                             HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(*x.shape[:-1], n)
