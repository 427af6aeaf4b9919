"""The Triton kernels for the release weight formats (ladle.kernels.triton_quant: FP8 widened in the GEMM's
inner loop; triton_moe's grouped GEMM over FP8 and MXFP4 experts) against the torch path on the same
quantized bytes, in Triton's interpreter on CPU; and both compile for sm_90."""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")

from ladle.kernels import triton_moe  # noqa: E402
from ladle.kernels.triton_quant import fp8_linear  # noqa: E402
from ladle.models.layers.moe import route  # noqa: E402
from ladle.models.layers.ops import TorchOps  # noqa: E402
from ladle.quantization.fp8_linear import Fp8ExpertStack, dequantize_blocks  # noqa: E402
from ladle.quantization.mxfp4 import Mxfp4ExpertStack  # noqa: E402
from ladle.testing.fp8_checkpoints import quantize_block_fp8, quantize_block_fp8_e8m0, quantize_mxfp4  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402


@pytest.mark.parametrize("n,k,rows", [(200, 256, 3), (128, 384, 17), (96, 130, 1)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_linear_equals_f_linear_on_the_widened_weight(n, k, rows, e8m0):
    """Ragged blocks in both directions, subnormal and negative-zero bytes, a bias; fp32 or E8M0 scales."""
    torch.manual_seed(n + k)
    quantize = quantize_block_fp8_e8m0 if e8m0 else quantize_block_fp8
    values, scales = quantize(torch.randn(n, k) * 0.05, (128, 128))
    values.view(torch.uint8).view(-1)[:16] = torch.arange(16, dtype=torch.uint8) | 0x80
    x, bias = torch.randn(rows, k), torch.randn(n)
    want = torch.nn.functional.linear(x, dequantize_blocks(values, scales, (128, 128), 0, torch.float32), bias)
    got = fp8_linear(x.to(DEVICE), values.to(DEVICE), scales.to(DEVICE), (128, 128), bias.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _stacks(fmt: str, w: torch.Tensor) -> Fp8ExpertStack | Mxfp4ExpertStack:
    if fmt == "mxfp4":
        packed, scales = zip(*(quantize_mxfp4(e) for e in w))
        return Mxfp4ExpertStack(torch.stack(packed).to(DEVICE), torch.stack(scales).to(DEVICE), torch.float32)
    values, scales = zip(*(quantize_block_fp8(e, (128, 128)) for e in w))
    return Fp8ExpertStack(torch.stack(values).to(DEVICE), torch.stack(scales).to(DEVICE), (128, 128), torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (9, 2), (33, 4)])
def test_quantized_experts_equal_the_torch_path(fmt, tokens, top_k):
    torch.manual_seed(tokens)
    experts, hidden, inter = 4, 128, 128
    w13, w2 = _stacks(fmt, torch.randn(experts, 2 * inter, hidden) * 0.1), _stacks(fmt, torch.randn(experts, hidden,
                                                                                                   inter) * 0.1)
    x = torch.randn(tokens, hidden, device=DEVICE)
    weights, ids = route(torch.randn(tokens, experts, device=DEVICE), top_k, True, torch.float32)
    want = TorchOps.fused_experts(x, w13, w2, weights, ids, swiglu_limit=7.0)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids, swiglu_limit=7.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fp8_linear_compiles_for_hopper():
    compile_for_sm90("""
from ladle.kernels.triton_quant import _fp8_linear_kernel
for dtype in ("*bf16", "*fp16", "*fp32"):
    types = {"x": dtype, "w": "*u8", "s": "*fp32", "bias": dtype, "y": dtype, "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
    for bias in (False, True):
        build(_fp8_linear_kernel, types, {"SCALE_N": 128, "SCALE_K": 128, "HAS_BIAS": bias, "BLOCK_M": 16,
                                          "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4)
print("compiled for sm_90")
""")
