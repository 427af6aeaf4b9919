"""Fused Triton kernels for the small per-layer ops of a decoder step on CUDA: RMSNorm (optionally with the
residual add), SiLU-and-mul, and per-head q/k RMSNorm + rotary embedding.

Each replaces several torch launches with one, which is what a decode step under a CUDA graph is made of.
Launches need only tensor shapes from the host (no syncs, no data-dependent host logic), so they can be
captured. Math is fp32 inside, but every intermediate that torch would hold in the model dtype is rounded to
it at the same point, so bf16/fp16 results match the torch reference in ladle.models.layers.decoder_layer bit for bit
(apart from rare values on a rounding boundary, flipped by a different fp32 reduction order or rsqrt).

CPU tensors mean Triton's interpreter is running (TRITON_INTERPRET=1, for tests without a GPU). It casts
fp32 to bfloat16 by truncation where a GPU rounds to nearest even, so there the rounding is done on the bits
first (INTERPRETED); on a GPU the native conversion rounds.

Launches disable FMA contraction: torch runs each product and sum as its own kernel, so a fused
multiply-add would round differently (it matters in fp32, where the casts between ops are no-ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """v (fp32) rounded to dtype and widened back: what torch's low-precision elementwise ops return."""
    if INTERPRETED and dtype == tl.bfloat16:
        # Round to nearest even at bit 16, so the interpreter's truncating cast below is exact.
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out,
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One program per row of N values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out.dtype.element_ty
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # torch rounds the sum to the dtype before the norm sees it.
        h = _rounded(h + r, dtype, INTERPRETED)
        tl.store(residual_out + row * stride_ro + offs, h.to(dtype), mask=mask)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    # HF casts the normalised row back to the dtype before the weight multiply.
    y = _rounded(w * _rounded(h * inv, dtype, INTERPRETED), dtype, INTERPRETED)
    tl.store(out + row * stride_o + offs, y.to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up, out, stride_g, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (row, tile) computes out[row, tile] from gate = gate_up[row, :N] and up = gate_up[row, N:]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out.dtype.element_ty
    src = gate_up + row * stride_g
    g = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + N + offs, mask=mask, other=0.0).to(tl.float32)
    if INTERPRETED:
        e = tl.exp(-g)  # the interpreter has no libdevice
    else:
        e = libdevice.exp(-g)  # CUDA's expf, which torch's silu kernel calls; tl.exp is a coarser ex2.approx
    # IEEE division as torch's; F.silu rounds its result to the dtype before the multiply by up.
    s = _rounded(tl.math.div_rn(g, 1.0 + e), dtype, INTERPRETED)
    tl.store(out + row * stride_o + offs, _rounded(s * u, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def _norm_rope_head(
    src, dst, weight, cos, sin, eps,
    HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One head of 2 * HALF values: optional RMSNorm, then rotary on its two halves (rotate_half pairs d with
    d + HALF), with torch's rounding after every op."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = dst.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        w1 = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = _rounded(w1 * _rounded(x1 * inv, dtype, INTERPRETED), dtype, INTERPRETED)
        x2 = _rounded(w2 * _rounded(x2 * inv, dtype, INTERPRETED), dtype, INTERPRETED)
    c1 = tl.load(cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded; round-to-nearest is symmetric, so rounding
    # (-x2) * s1 equals negating the rounded x2 * s1.
    o1 = _rounded(x1 * c1, dtype, INTERPRETED) - _rounded(x2 * s1, dtype, INTERPRETED)
    o2 = _rounded(x2 * c2, dtype, INTERPRETED) + _rounded(x1 * s2, dtype, INTERPRETED)
    tl.store(dst + offs, _rounded(o1, dtype, INTERPRETED).to(dtype), mask=mask)
    tl.store(dst + HALF + offs, _rounded(o2, dtype, INTERPRETED).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q, k, q_weight, k_weight, cos, sin, q_out, k_out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, eps,
    HQ: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (t, h): query head h of token t for h < HQ, else key head h - HQ; one launch serves both."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = tl.num_programs(1) - HQ
    c = cos + t * stride_ct
    s = sin + t * stride_st
    if h < HQ:
        _norm_rope_head(q + t * stride_qt + h * stride_qh, q_out + (t * HQ + h) * (2 * HALF), q_weight, c, s, eps,
                        HALF, BLOCK, Q_NORM, INTERPRETED)
    else:
        kh = h - HQ
        _norm_rope_head(k + t * stride_kt + kh * stride_kh, k_out + (t * hk + kh) * (2 * HALF), k_weight, c, s,
                        eps, HALF, BLOCK, K_NORM, INTERPRETED)


def _interpreted(x: torch.Tensor) -> bool:
    """CPU tensors mean Triton's interpreter is running."""
    return x.device.type == "cpu"


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """Kernels address the last dim densely; projections produce that, so this copies only odd inputs."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_warps(block: int) -> int:
    # About 8 values per thread for wide rows, one warp for a head or a tiny hidden size.
    return min(8, max(1, block // 256))


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() != 2 or weight.shape != x.shape[1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm wants x [T, H] and weight [H]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    residual_out = None if residual is None else torch.empty_like(out)
    if t == 0:
        return out, residual_out
    x, weight = _unit_stride(x), _unit_stride(weight)
    r = x if residual is None else _unit_stride(residual)  # a placeholder pointer when there is no residual
    ro = out if residual_out is None else residual_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](
        x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), eps,
        N=n, BLOCK=block, ADD_RESIDUAL=residual is not None, INTERPRETED=_interpreted(x),
        num_warps=_row_warps(block), enable_fp_fusion=False,
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward of x [T, H] with weight [H] (held in x's dtype, as the model does) -> new [T, H]."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [T, H], as new tensors; inputs are untouched."""
    normed, new_residual = _rms_norm(x, residual, weight, eps)
    assert new_residual is not None
    return normed, new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I] -> new [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul wants gate_up [T, 2I]; got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or n == 0:
        return out
    gate_up = _unit_stride(gate_up)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        N=n, BLOCK=block, INTERPRETED=_interpreted(gate_up), num_warps=4 if block >= 512 else 1,
        enable_fp_fusion=False,
    )
    return out


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary(RMSNorm(q)), apply_rotary(RMSNorm(k)) for q [T, Hq, D], k [T, Hk, D] (views with any token
    and head strides), cos/sin [T, D] in the model dtype; a None weight skips that norm. -> new contiguous
    [T, Hq, D], [T, Hk, D]."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)} do not fit [T, H, D] / [T, D] with an even D")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0 or hq + hk == 0:
        return q_out, k_out
    q, k, cos, sin = (_unit_stride(x) for x in (q, k, cos, sin))
    qw = q if q_weight is None else _unit_stride(q_weight)  # placeholder pointers when a norm is skipped
    kw = k if k_weight is None else _unit_stride(k_weight)
    block = triton.next_power_of_2(d // 2)
    _qk_norm_rope_kernel[(t, hq + hk)](
        q, k, qw, kw, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), eps,
        HQ=hq, HALF=d // 2, BLOCK=block, Q_NORM=q_weight is not None, K_NORM=k_weight is not None,
        INTERPRETED=_interpreted(q), num_warps=_row_warps(block), enable_fp_fusion=False,
    )
    return q_out, k_out
