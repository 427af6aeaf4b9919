"""CpuLinear (ladle.models.layers.cpu_linear): skinny_linear for decode-sized inputs, F.linear above, checked against
F.linear on odd shapes, both dtypes, with and without bias; and what a loaded model's layers became."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ladle.kernels.cpu_isa import CpuIsa, kernel_levels
from ladle.kernels.cpu_kernels import load
from ladle.models.layers.cpu_linear import SKINNY_MAX_ROWS, CpuLinear, use_cpu_linears


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features", [(64, 33), (40, 7), (512, 96), (48, 5)])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, SKINNY_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(level: CpuIsa, dtype: torch.dtype, in_features: int, out_features: int, rows: int,
                          bias: bool) -> None:
    """Each build's paths: widths of 32 (AVX-512 BF16 pairs), 16 (AVX-512), 8 (AVX2) and 40 (AVX2 only above
    scalar), odd row counts."""
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(2, rows, in_features, generator=g).to(dtype)[1]  # a view, not contiguous storage start
    layer = CpuLinear(weight, b, load(level))
    got = layer(x)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_leading_dims_and_empty_input() -> None:
    layer = CpuLinear(torch.randn(16, 24), None, load())
    x = torch.randn(2, 3, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    assert layer(torch.randn(0, 24)).shape == (0, 16)


def test_replaces_every_linear_over_the_same_weight() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(3, 8)
    want = model(x)
    assert use_cpu_linears(model, load()) == 2
    layers = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert all(m.weight is w for m, w in zip(layers, weights))  # the same tensors: nothing copied
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(level: CpuIsa, dtype: torch.dtype) -> None:
    """A lone decode row (the batch-1 tile where a level has one) gives the bits it gets beside other rows."""
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(70, 96, generator=g) / 10).to(dtype)
    x = torch.randn(6, 96, generator=g).to(dtype)
    layer = CpuLinear(weight, None, load(level))
    together = layer(x)
    for i in range(6):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])
