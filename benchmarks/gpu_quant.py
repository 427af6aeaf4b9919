"""The device script's FP8 / MXFP4 section: ladle's Triton kernels for the release weight formats against the
torch path on the same bytes, and their time against bf16 at a Qwen3-8B projection's shape."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def _median_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fp8_check(device: torch.device, small: bool) -> dict[str, Any]:
    """Max relative error of the FP8 GEMM and the FP8 / MXFP4 grouped expert GEMMs (want ~1e-3 in bf16; `ok`
    when all are within tolerance); the FP8 GEMM's median time over bf16 F.linear per row count (decode rows
    want < 1: half the bytes), and each grouped GEMM's over the same kernel on its widened bf16 experts."""
    import torch.nn.functional as F

    from ladle.kernels import triton_moe
    from ladle.kernels.triton_quant import fp8_linear
    from ladle.models.layers.moe import route
    from ladle.models.layers.ops import TorchOps
    from ladle.quantization.fp8_linear import Fp8ExpertStack, dequantize_blocks
    from ladle.quantization.mxfp4 import Mxfp4ExpertStack
    from ladle.testing.fp8_checkpoints import quantize_block_fp8, quantize_mxfp4

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n, k = (256, 256) if small else (4096, 4096)
    torch.manual_seed(0)
    values, scales = (t.to(device) for t in quantize_block_fp8(torch.randn(n, k) * 0.02, (128, 128)))
    dense = dequantize_blocks(values, scales, (128, 128), 0, dtype)
    out: dict[str, Any] = {"shape": [n, k], "fp8_linear": {}}
    for rows in ((1, 17) if small else (1, 16, 2048)):
        x = torch.randn(rows, k, device=device, dtype=dtype)
        want = F.linear(x.float(), dense.float())
        got = fp8_linear(x, values, scales, (128, 128)).float()
        entry = {"max_rel_err": ((got - want).abs().max() / want.abs().max()).item()}
        if not small:
            fp8_ms = _median_ms(lambda: fp8_linear(x, values, scales, (128, 128)), device, 20)
            bf16_ms = _median_ms(lambda: F.linear(x, dense), device, 20)
            entry |= {"fp8_ms": round(fp8_ms, 4), "bf16_ms": round(bf16_ms, 4), "fp8_over_bf16": fp8_ms / bf16_ms}
        out["fp8_linear"][str(rows)] = entry
    experts, hidden, inter, tokens = (4, 128, 128, 9) if small else (8, 2048, 1024, 16)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weights, ids = route(torch.randn(tokens, experts, device=device), 2, True, dtype)
    for fmt in ("fp8", "mxfp4"):
        stacks = []
        for shape in ((experts, 2 * inter, hidden), (experts, hidden, inter)):
            w = torch.randn(*shape) * 0.05
            if fmt == "fp8":
                v, s = zip(*(quantize_block_fp8(e, (128, 128)) for e in w))
                stacks.append(Fp8ExpertStack(torch.stack(v).to(device), torch.stack(s).to(device), (128, 128), dtype))
            else:
                v, s = zip(*(quantize_mxfp4(e) for e in w))
                stacks.append(Mxfp4ExpertStack(torch.stack(v).to(device), torch.stack(s).to(device), dtype))
        want = TorchOps.fused_experts(x, *stacks, weights, ids).float()
        got = triton_moe.fused_experts(x, *stacks, weights, ids).float()
        out[f"{fmt}_experts_max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        if not small:  # against the same kernel on the widened (dequantized) stacks
            dense_stacks = [torch.stack([st[e] for e in range(experts)]) for st in stacks]
            q_ms = _median_ms(lambda: triton_moe.fused_experts(x, *stacks, weights, ids), device, 20)
            d_ms = _median_ms(lambda: triton_moe.fused_experts(x, *dense_stacks, weights, ids), device, 20)
            out[f"{fmt}_experts_ms"], out[f"{fmt}_experts_over_bf16"] = round(q_ms, 4), q_ms / d_ms
    # A wrong scale or index is off by O(1); bf16 rounding of the output alone is about 4e-3.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    errors = [e["max_rel_err"] for e in out["fp8_linear"].values()]
    out["ok"] = max(errors + [out["fp8_experts_max_rel_err"], out["mxfp4_experts_max_rel_err"]]) < tol
    return out
