"""Measured memory: what the device has, what ladle may use, and the peak a piece of work allocates."""
from __future__ import annotations

from collections.abc import Callable

import torch


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo")


def device_budget(
    device: torch.device, gpu_memory_utilization: float, memory_budget: int | None, free: int, total: int
) -> tuple[int, str]:
    """Bytes ladle may use for weights + KV pool + activations, and why. `free` is measured before loading."""
    if device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        budget = int(gpu_memory_utilization * total)
        if budget > free:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} asks for {budget / 2**30:.2f} GiB of "
                f"{total / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB are free; the largest that fits "
                f"is {int(free / total * 100) / 100:.2f}"
            )
        reason = f"gpu_memory_utilization {gpu_memory_utilization} x {total / 2**30:.1f} GiB"
    else:
        budget, reason = free, "available RAM"
    if memory_budget is not None and memory_budget < budget:
        return memory_budget, "explicit --memory-budget"
    if memory_budget is not None:
        return budget, f"{reason} (below the explicit --memory-budget)"
    return budget, reason


def measure_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while fn runs, above what was allocated before it.

    CUDA: the allocator's own peak counter. CPU: torch.profiler records every allocation and free in order;
    the peak of their running sum is exact, unlike sampling RSS.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    import os

    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a line at every profiler start and stop; startup profiles often, so keep the log clean
    # unless the user asked for Kineto's logging.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak
