"""The device run's tiered-experts section (issue 38): a Qwen3-MoE model with its routed experts resident, then in
pinned host memory behind a cache of a quarter of them (offload with prefetch, the CUDA default; hybrid; cpu):
greedy agreement with the resident run, batch-1 decode tok/s, prefill time, hit rates. On CUDA the resident layer
runs Triton's grouped GEMM and a tiered one the per-expert loop, so bf16 tokens may part on a rounding tie: the
agreement is reported, not asserted (exactness is tested on CPU in fp32)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ladle.demo import build_checkpoint

SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# 0.8 GB of bf16 experts (8 layers x 32 experts x 3 x 1024 x 512), a quarter cached.
LARGE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, intermediate_size=2816, moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4)
VARIANTS = {"resident": {}, "offload 25%": {"moe_cache_fraction": 0.25},
            "offload 25%, no prefetch": {"moe_cache_fraction": 0.25, "moe_prefetch": False},
            "hybrid 25%": {"moe_cache_fraction": 0.25, "moe_strategy": "hybrid"}, "cpu": {"moe_strategy": "cpu"}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expert_tiering_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    from ladle import LLM, SamplingParams

    shape = SMALL if small else LARGE
    path = build_checkpoint(workdir / "tiered_moe", "qwen3_moe", norm_topk_prob=True, max_position_embeddings=8192,
                            seed=5, **shape)
    prompts = [[(7 * i + j) % shape["vocab_size"] for j in range(16 + 8 * i)] for i in range(4)]
    long_prompt = [(13 * j) % shape["vocab_size"] for j in range(256 if small else 4096)]
    greedy = SamplingParams(temperature=0, max_tokens=16 if small else 64, ignore_eos=True)
    out: dict[str, Any] = {}
    for name, kwargs in VARIANTS.items():
        # The dry run's context is 1024 (its longest prompt is 256): start-up profiles activations up to it.
        llm = LLM(path, device=str(device), max_model_len=1024 if small else 8192,
                  max_num_batched_tokens=1024 if small else 2048, **kwargs)
        tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                                 use_tqdm=False)]
        _sync(device)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": long_prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        stats = llm.stats
        n = len(stats.steps)
        llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        decode = [s for s in list(stats.steps)[n:] if s.num_prefill_chunks == 0]
        e = stats.experts
        out[name] = {"tokens": tokens, "prefill_s": round(prefill_s, 3),
                     "decode_tok_s": round(len(decode) / (sum(s.ms for s in decode) / 1000), 1),
                     "hit_rate": round(e.hits / max(1, e.hits + e.misses), 3) if e else None,
                     "tiered": getattr(llm.engine.core.config.settings.get("tiered_experts"), "value", "")}
        llm.shutdown()
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = out["resident"]
    want = base["tokens"]
    for r in out.values():
        same = sum(a == b for x, y in zip(r["tokens"], want) for a, b in zip(x, y))
        r["agreement"] = round(same / sum(len(x) for x in want), 3)
        r["decode_ratio"] = round(r["decode_tok_s"] / base["decode_tok_s"], 3)
        r["prefill_ratio"] = round(base["prefill_s"] / r["prefill_s"], 3)
    for r in out.values():
        del r["tokens"]
    return out
