"""Chunking overhead: prefill time of one long prompt at several step budgets vs a single pass.

One engine is started with the largest budget (the single pass); each smaller budget is applied to that
same engine's scheduler config (the only reader of the budget), so every budget runs on the same weights,
pool and process. Each run is checked: its largest step and its chunk count must match the budget. Per
repeat every budget runs once (rotating order) on a fresh random prompt (no prefix-cache hits), and its time
is divided by the single pass of the same repeat; the table reports medians. An HF forward of the same
prompt (SDPA, one pass, logits of the last token only) is timed in the same repeats as a reference.

    python benchmarks/chunk_overhead.py --prompt-len 8192 --budgets 256 512 1024 2048 8192
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save, set_budget  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402


def timed_prefill(llm: LLM, ids: list[int], budget: int) -> tuple[float, float]:
    """(wall s, process CPU s) of generating one token from the prompt, checked against the budget."""
    set_budget(llm.engine.core, budget)
    stats = llm.stats
    first_step = getattr(stats, "num_steps", len(stats.steps))
    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    steps = [s for s in stats.steps if s.step >= first_step]
    chunks = out[0].outputs[0].prefill_chunks
    assert max(s.num_tokens for s in steps) <= budget, "a step exceeded the budget: the override did not apply"
    assert len(chunks) == -(-len(ids) // budget), f"expected {-(-len(ids) // budget)} chunks, got {chunks}"
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--out", default="chunk_overhead")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    single = max(max(args.budgets), args.prompt_len)
    budgets = sorted(set(args.budgets) | {single})
    llm = LLM(model_dir, max_num_batched_tokens=single, max_model_len=args.prompt_len + 16,
              num_kv_blocks=-(-(args.prompt_len + 16) // 16) + 16, enable_prefix_caching=False)
    hf = None
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    timed_prefill(llm, [rng.randrange(vocab) for _ in range(512)], 512)  # warm-up
    wall: dict[int, list[float]] = {b: [] for b in budgets}
    cpu: dict[int, list[float]] = {b: [] for b in budgets}
    ratio: dict[int, list[float]] = {b: [] for b in budgets}
    hf_wall: list[float] = []
    for rep in range(args.repeats):
        ids = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        order = budgets[rep % len(budgets):] + budgets[: rep % len(budgets)]
        for b in order:
            w, c = timed_prefill(llm, ids, b)
            wall[b].append(w)
            cpu[b].append(c)
            print(f"repeat {rep} budget {b}: {w:.2f} s wall, {c:.2f} s CPU", flush=True)
        for b in budgets:
            ratio[b].append(wall[b][-1] / wall[single][-1])
        if hf is not None:
            start = time.perf_counter()
            with torch.inference_mode():
                hf(torch.tensor([ids]), logits_to_keep=1)
            hf_wall.append(time.perf_counter() - start)
            print(f"repeat {rep} HF forward: {hf_wall[-1]:.2f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for b in budgets:
        rows.append({"budget": b, "chunks": -(-args.prompt_len // b), "wall_s_median": statistics.median(wall[b]),
                     "cpu_s_median": statistics.median(cpu[b]), "vs_single_median": statistics.median(ratio[b]),
                     "vs_single_per_repeat": ratio[b], "wall_s": wall[b]})
    save(args.out, {
        "benchmark": "chunk_overhead", "model": args.model_name, "model_config": model_facts(model_dir),
        "prompt_len": args.prompt_len, "single_pass_budget": single, "repeats": args.repeats, "rows": rows,
        "hf_forward_s": hf_wall, "hf_forward_s_median": statistics.median(hf_wall) if hf_wall else None,
        "hf_over_ladle_single_median": (statistics.median([h / w for h, w in zip(hf_wall, wall[single])])
                                        if hf_wall else None),
        "goal": "budget 512 costs at most 10% over the single pass",
    })


if __name__ == "__main__":
    main()
