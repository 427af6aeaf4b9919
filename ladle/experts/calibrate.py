"""moe_strategy hybrid: the token count up to which computing a missed expert where it lives beats fetching it,
from costs measured at startup on this machine (as the field report's engine calibrates its CPU/GPU split by a
bandwidth benchmark). A miss computed in place costs reading it there (nothing for host memory, a read for the
files) plus the host's compute; a fetch costs the copy into a slot plus the device's compute."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ladle.experts.compute import expert_mlp
from ladle.experts.tiered import TieredExperts

ALWAYS = 1 << 30  # a threshold above every step's tokens
PROBE_TOKENS = (1, 16)


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def calibrate_hybrid(layer: TieredExperts, stacks_of: Callable, hidden: int, dtype: torch.dtype,
                     device: torch.device, swiglu_limit: float | None) -> tuple[int, str]:
    """The largest token count a miss is computed in place at (-1: never), and how it was found."""
    cache, backing = layer.cache, layer.backing
    slots = cache.slot_tensors()
    slot_w13, slot_w2 = stacks_of(dtype, slots)
    fetch = _median_seconds(lambda: backing.read_into(0, {n: t[0] for n, t in slots.items()}), device)
    in_place_read = _median_seconds(lambda: backing.expert(0), torch.device("cpu"))
    host = {name: t.unsqueeze(0) for name, t in backing.expert(0).items()}
    host_w13, host_w2 = stacks_of(dtype, host)
    costs = {}
    for n in PROBE_TOKENS:
        x = torch.randn(n, hidden, dtype=dtype)
        on_device = x.to(device)
        # Each lambda is timed at once, inside its own iteration: the loop variables are the ones meant (B023).
        costs[n] = (_median_seconds(lambda: expert_mlp(x, host_w13, host_w2, 0, swiglu_limit),  # noqa: B023
                                    torch.device("cpu")),
                    _median_seconds(lambda: expert_mlp(on_device, slot_w13, slot_w2, 0, swiglu_limit), device))  # noqa: B023
    cache.clear()
    (h_lo, d_lo), (h_hi, d_hi) = costs[PROBE_TOKENS[0]], costs[PROBE_TOKENS[1]]
    span = PROBE_TOKENS[1] - PROBE_TOKENS[0]
    h1, d1 = (h_hi - h_lo) / span, (d_hi - d_lo) / span
    h0, d0 = h_lo - h1 * PROBE_TOKENS[0], d_lo - d1 * PROBE_TOKENS[0]
    # In place wins at n tokens while in_place_read + h0 + h1 n < fetch + d0 + d1 n.
    gap = fetch + d0 - in_place_read - h0
    if h1 <= d1:
        threshold = ALWAYS if gap > 0 else -1
    else:
        threshold = int(gap / (h1 - d1)) if gap > 0 else -1
    what = ("every miss computed in place" if threshold >= ALWAYS else "every miss fetched" if threshold < 1
            else f"a miss with at most {threshold} tokens computed in place, more fetched")
    return threshold, (f"{what} (measured: fetch {fetch * 1e3:.3f} ms an expert; in place: read "
                       f"{in_place_read * 1e3:.3f} ms + {h1 * 1e6:.1f} us a token; in a slot {d1 * 1e6:.1f} us a "
                       "token)")
