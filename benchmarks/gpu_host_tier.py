"""The device run's host-tier section (the prefix cache's tier in pinned host memory, over PCIe on a GPU).

- `copy`: the runner's host-tier copies (ladle.runner.host_kv_cache) of Qwen3-8B-shaped blocks (36 layers of K and
  V pages, 16 tokens x 8 KV heads x 128 dims, bf16: 2.25 MiB a block), device -> host (a demotion) and host ->
  device (a promotion, what a hit waits for), 256 blocks at a time: microseconds per block and GB/s.
- `sessions`: benchmarks/agent_sessions.py's replay (sessions sharing a system prompt take turns against a KV pool
  that holds a quarter of them) on a ~100M Qwen3 in bf16, the host tier off (kv_offloading_size=0: on CUDA it is
  derived on) and on: the replies must be the same (`ok`), and the later turns' computed/new tokens and TTFT p50
  show what the tier saves once its copies cross PCIe.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from agent_sessions import engine_for, replay, summary
from common import MODELS, build_model
from ladle.runner.host_kv_cache import HostKVCache

BLOCK_8B = (16, 8, 128)  # tokens, KV heads, head dim
LAYERS_8B = 36


def _copy_speed(device: torch.device, small: bool) -> dict[str, Any]:
    layers, page, blocks, batch = (2, (16, 2, 16), 64, 16) if small else (LAYERS_8B, BLOCK_8B, 1024, 256)
    dtype = torch.bfloat16
    pool = [torch.zeros((blocks, *page), dtype=dtype, device=device) for _ in range(2 * layers)]
    cache = HostKVCache(pool, batch)
    block_bytes = sum(t[0].numel() * t.element_size() for t in pool)
    pairs = [(b, s) for s, b in enumerate(range(0, 2 * batch, 2))]  # every other block: a gather, as in a step

    def timed(fn: Any) -> float:
        fn()  # warm
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    save = timed(lambda: cache.save(pairs))
    load = timed(lambda: cache.load([(s, b) for b, s in pairs]))
    ok = all(torch.equal(h[: len(pairs)].to(device), t[0 : 2 * batch : 2]) for t, h in zip(pool, cache.host))
    return dict(block_bytes=block_bytes, blocks_per_copy=batch, pinned=cache.host[0].is_pinned(),
                demote_us_per_block=round(1e6 * save / batch, 1), promote_us_per_block=round(1e6 * load / batch, 1),
                demote_gb_s=round(block_bytes * batch / save / 1e9, 2),
                promote_gb_s=round(block_bytes * batch / load / 1e9, 2), ok=ok)


def _sessions(small: bool) -> dict[str, Any]:
    path, vocab = build_model("qwen3-768"), MODELS["qwen3-768"]["vocab_size"]
    args = argparse.Namespace(sessions=8, turns=4, concurrency=2, prefix=4096, first=2048, tool=512, reply=32, seed=0,
                              vocab=vocab, pool_sessions=0.25, one_offs=0, one_off_tokens=0, replies={})
    if small:
        args.sessions, args.turns, args.prefix, args.first, args.tool, args.reply = 4, 3, 128, 64, 32, 4
    runs = {}
    for tier in ("off", "1GiB"):
        args.replies = {}
        with engine_for(path, args, tier, None) as llm:
            rows = replay(llm, args, range(args.turns))
        runs[tier] = dict(summary(rows), replies=[r["reply"] for r in sorted(rows, key=lambda r: (r["session"],
                                                                                                 r["turn"]))])
    off, on = runs.values()
    out = {tier: {k: v for k, v in run.items() if k not in ("replies", "per_turn")} for tier, run in runs.items()}
    out["replies_identical"] = off["replies"] == on["replies"]
    out["ttft_p50_off_over_on"] = round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2)
    out["ok"] = out["replies_identical"] and on["computed_over_new_median"] < off["computed_over_new_median"]
    return out


def host_tier_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    copy = _copy_speed(device, small)
    sessions = _sessions(small)
    return dict(copy=copy, sessions=sessions, ok=copy["ok"] and sessions["ok"])
