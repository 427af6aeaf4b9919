"""The fused Triton ops (RMSNorm, add + RMSNorm, SiLU-and-mul, q/k norm + rope) against the torch reference
in ladle.models.layers.decoder_layer.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 must be set before
any kernel is decorated, so it is set before ladle's Triton module is imported. With a GPU the same tests run
the compiled kernels on CUDA tensors. In bf16/fp16 the kernels round where torch rounds, so nearly every
element must be bitwise equal to the reference (a fused op that rounds once at the end would fail that).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")

from ladle.models.layers.decoder_layer import RMSNorm
from ladle.models.layers.ops import apply_rotary
from ladle.kernels import triton_ops as ops
from sm90 import compile_for_sm90  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol): fp32 differs only by reduction order / rsqrt; low precision by at most one ulp, rarely.
TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}
EPS = 1e-6


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Close within the dtype's tolerance, and in low precision at least 99% of elements bitwise equal."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    atol, rtol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if want.dtype != torch.float32 and want.numel():
        same = (got.view(torch.int16) == want.view(torch.int16)).float().mean().item()
        assert same >= 0.99, f"only {same:.2%} of elements are bitwise equal to torch's"


def reference_norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (7, 96), (7, 256)])
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = randn(tokens, hidden, dtype=dtype, seed=hidden, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=1) + 1
    with torch.no_grad():
        want = reference_norm(weight, EPS)(x)
    assert_matches(ops.rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 96), (7, 40)])
def test_fused_add_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x = randn(tokens, hidden, dtype=dtype, seed=2)
    residual = randn(tokens, hidden, dtype=dtype, seed=3, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=4) + 1
    want_residual = x + residual
    with torch.no_grad():
        want = reference_norm(weight, EPS)(want_residual)
    xd, rd = x.to(DEVICE), residual.to(DEVICE)
    normed, new_residual = ops.fused_add_rms_norm(xd, rd, weight.to(DEVICE), EPS)
    assert torch.equal(new_residual.cpu(), want_residual)  # one rounded add, exactly as torch does it
    assert_matches(normed, want)
    assert torch.equal(xd.cpu(), x) and torch.equal(rd.cpu(), residual)  # inputs untouched


def test_rms_norm_strided_rows() -> None:
    """Rows of a wider buffer (a column slice) are read through their stride."""
    wide = randn(5, 70, dtype=torch.bfloat16, seed=5)
    x, weight = wide[:, 10:50], randn(40, dtype=torch.bfloat16, seed=6)
    with torch.no_grad():
        want = reference_norm(weight, EPS)(x)
    assert_matches(ops.rms_norm(wide.to(DEVICE)[:, 10:50], weight.to(DEVICE), EPS), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 40), (7, 96), (2, 1100)])  # 1100 spans two 1024-wide tiles
def test_silu_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    gate_up = randn(tokens, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert_matches(ops.silu_and_mul(gate_up.to(DEVICE)), want)


def rope_tables(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as RotaryEmbedding builds them: fp32 angles, cast to the model dtype."""
    positions = torch.tensor([0, 1, 5, 17, 100, 511, 4000])[:tokens].float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 32), (7, 6, 2, 16), (7, 2, 1, 64)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int, with_norm: bool) -> None:
    """q and k are strided views into one fused qkv projection, as the model produces them."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=dim + heads, scale=2.0)
    cos, sin = rope_tables(tokens, dim, dtype)
    q_weight = randn(dim, dtype=dtype, seed=8) + 1 if with_norm else None
    k_weight = randn(dim, dtype=dtype, seed=9) + 1 if with_norm else None

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
        return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)

    q, k = split(qkv)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous())  # rows of the fused projection
    with torch.no_grad():
        if with_norm:
            q, k = reference_norm(q_weight, EPS)(q), reference_norm(k_weight, EPS)(k)
        want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    weights = [None if w is None else w.to(DEVICE) for w in (q_weight, k_weight)]
    got_q, got_k = ops.qk_norm_rope(*split(qkv.to(DEVICE)), *weights, cos.to(DEVICE), sin.to(DEVICE), EPS)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


def test_qk_norm_rope_one_norm_only() -> None:
    """A weight for q but none for k normalises q alone."""
    q, k = randn(3, 2, 16, dtype=torch.bfloat16, seed=10), randn(3, 1, 16, dtype=torch.bfloat16, seed=11)
    weight = randn(16, dtype=torch.bfloat16, seed=12)
    cos, sin = rope_tables(3, 16, torch.bfloat16)
    with torch.no_grad():
        want_q = apply_rotary(reference_norm(weight, EPS)(q), cos, sin)
    got_q, got_k = ops.qk_norm_rope(q.to(DEVICE), k.to(DEVICE), weight.to(DEVICE), None, cos.to(DEVICE),
                                    sin.to(DEVICE), EPS)
    assert_matches(got_q, want_q)
    assert_matches(got_k, apply_rotary(k, cos, sin))


def test_empty_batch() -> None:
    """T = 0 (an idle step) returns empty outputs of the right shapes without launching."""
    x, w = torch.empty(0, 40, device=DEVICE), torch.ones(40, device=DEVICE)
    assert ops.rms_norm(x, w, EPS).shape == (0, 40)
    normed, residual = ops.fused_add_rms_norm(x, x, w, EPS)
    assert normed.shape == residual.shape == (0, 40)
    assert ops.silu_and_mul(torch.empty(0, 80, device=DEVICE)).shape == (0, 40)
    cos = torch.empty(0, 16, device=DEVICE)
    q, k = ops.qk_norm_rope(torch.empty(0, 4, 16, device=DEVICE), torch.empty(0, 2, 16, device=DEVICE),
                            None, None, cos, cos, EPS)
    assert q.shape == (0, 4, 16) and k.shape == (0, 2, 16)


# Compiled for sm_90 by tests/sm90.py (prelude: imports and build()).
_COMPILE_FOR_SM90 = """
from ladle.kernels import triton_ops as ops

_build = build

def build(kernel, types, consts, **options):
    return _build(kernel, types, consts, enable_fp_fusion=False, **options)  # as the wrappers launch them

ints = lambda *names: {n: "i32" for n in names}
for dt in ("*bf16", "*fp16", "*fp32"):
    for n, add in [(4096, True), (5120, False), (40, True)]:
        block = triton.next_power_of_2(n)
        build(ops._rms_norm_kernel, dict(x=dt, residual=dt, weight=dt, out=dt, residual_out=dt, eps="fp32",
              **ints("stride_x", "stride_r", "stride_o", "stride_ro")),
              dict(N=n, BLOCK=block, ADD_RESIDUAL=add, INTERPRETED=False), num_warps=ops._row_warps(block))
    for n in (17408, 40):
        build(ops._silu_and_mul_kernel, dict(gate_up=dt, out=dt, **ints("stride_g", "stride_o")),
              dict(N=n, BLOCK=min(1024, triton.next_power_of_2(n)), INTERPRETED=False), num_warps=4)
    for half, q_norm, k_norm in [(64, True, True), (32, False, False), (64, True, False)]:
        build(ops._qk_norm_rope_kernel, dict(q=dt, k=dt, q_weight=dt, k_weight=dt, cos=dt, sin=dt, q_out=dt,
              k_out=dt, eps="fp32", **ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ct",
              "stride_st")), dict(HQ=32, HALF=half, BLOCK=half, Q_NORM=q_norm, K_NORM=k_norm, INTERPRETED=False),
              num_warps=1)
print("compiled for sm_90")
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    compile_for_sm90(_COMPILE_FOR_SM90)
