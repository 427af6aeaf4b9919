"""CpuOps (ladle.models.layers.cpu_ops): the C versions of RMSNorm, residual add + RMSNorm and q/k norm + rope against
TorchOps, the HF-exact torch versions, on strided views, both dtypes, with and without q/k norms."""
from __future__ import annotations

import pytest
import torch

from ladle.kernels.cpu_isa import kernel_levels
from ladle.kernels.cpu_kernels import load
from ladle.models.layers.cpu_ops import CpuOps
from ladle.models.layers.decoder_layer import RotaryEmbedding
from ladle.models.layers.ops import TorchOps


@pytest.fixture(scope="module", params=kernel_levels(), ids=lambda level: level.label)
def ops(request: pytest.FixtureRequest) -> CpuOps:
    return CpuOps(load(request.param))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the order of one sum of squares: a few fp32 ulps, or one bf16 rounding step."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if got.dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add(ops: CpuOps, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    close(ops.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6))
    wide = torch.randn(3, 4, 200, generator=g).to(dtype)[..., 50:146]  # strided rows, leading dims kept
    close(ops.rms_norm(wide, w, 1e-6), TorchOps.rms_norm(wide, w, 1e-6))
    out, total = ops.add_rms_norm(x, res, w, 1e-6)
    want_out, want_total = TorchOps().add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, want_total)  # the residual sum is one rounding, as torch's
    close(out, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [True, False])
def test_qk_norm_rope_on_qkv_views(ops: CpuOps, dtype: torch.dtype, normed: bool) -> None:
    from transformers import Qwen3Config

    heads, kv_heads, d, t = 4, 2, 32, 7
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)  # views with the qkv row's stride, as Attention makes
    q_w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if normed else None
    k_w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if normed else None
    rope = RotaryEmbedding(Qwen3Config(head_dim=d, num_attention_heads=heads, hidden_size=heads * d))
    cos, sin = rope(torch.tensor([0, 1, 5, 17, 300, 4095, 9]), dtype)
    got = ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, 1e-6)
    want = TorchOps().qk_norm_rope(q, k, q_w, k_w, cos, sin, 1e-6)
    for a, b in zip(got, want):
        if normed:
            close(a, b)
        else:
            assert torch.equal(a, b)  # rope alone: the same products and sums, rounded the same way


def test_uncovered_inputs_take_the_torch_path(ops: CpuOps) -> None:
    x = torch.randn(3, 8, dtype=torch.float16)
    w = torch.ones(8, dtype=torch.float16)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6))
    mixed = torch.randn(3, 8)
    assert torch.equal(ops.rms_norm(mixed, w.float().double(), 1e-6), TorchOps.rms_norm(mixed, w.double(), 1e-6))
