"""One projection at batch 1, alone: ladle's fp8_linear C kernel against the bf16 weights' skinny_linear on the
same values, so the kernel's own speed shows without the rest of a decode step (the head, attention, sampling).

    python benchmarks/quantized_layer.py        # seconds; medians of 200 calls, 2 threads
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ladle.kernels.cpu_kernels import load
from ladle.models.layers.cpu_linear import CpuLinear
from ladle.quantization.fp8_linear import fp8_kernel_linear
from ladle.testing.fp8_checkpoints import quantize_block_fp8


def median_us(fn: Callable[[], object], repeats: int = 200) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    kernels = load()
    for n, k in ((4096, 768), (768, 2048)):  # qwen3-768's gate_up and down projections
        values, scales = quantize_block_fp8(torch.randn(n, k) * 0.02, (128, 128))
        bf16 = CpuLinear(values.float().bfloat16(), None, kernels)
        x = torch.randn(1, k).bfloat16()
        fp8_us = median_us(lambda: fp8_kernel_linear(kernels, x, values, scales, (128, 128), None))
        bf16_us = median_us(lambda: bf16(x))
        print(f"{n} x {k}: fp8 {fp8_us:.0f} us, bf16 {bf16_us:.0f} us, fp8 / bf16 time {fp8_us / bf16_us:.2f}")


if __name__ == "__main__":
    main()
