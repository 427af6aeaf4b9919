"""Stall-free decoding: inter-token latency of running decodes while a long prompt arrives.

--decodes requests (short prompts, long outputs) decode for --warm-steps steps; then one --long-prompt
token request arrives. The engine is stepped (LLMEngine.step, the loop LLM.generate runs) until the long
request has its first token plus --tail-steps more; every decode token is timestamped. Per config the
window is [arrival, end]: max ITL of the decodes in it, and the median step time in it (the steps' own
durations, as the core records them). Goal: with chunking, max ITL <= 2 x that median.

Configs are step budgets on one engine started with the largest (the no-chunking one, which prefills the
long prompt in one step); a smaller budget is applied to the scheduler's config, as benchmarks/
chunk_overhead.py does, and checked from the core's counters.

    python benchmarks/stall_free.py --long-prompt 16384 --decodes 8 --budgets 512 2048 0
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save, set_budget  # noqa: E402

from ladle.frontend.llm_engine import LLMEngine  # noqa: E402
from ladle.sampling_params import SamplingParams  # noqa: E402


def run_once(engine: LLMEngine, budget: int, args: argparse.Namespace, vocab: int, seed: int) -> dict[str, Any]:
    set_budget(engine.core, budget)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    ids = [f"s{seed}-d{i}" for i in range(args.decodes)]
    for rid in ids:
        engine.add_request(rid, None, [rng.randrange(vocab) for _ in range(args.decode_prompt)], params)
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    stats = engine.core.stats
    chunks_of: dict[str, list[int]] = {}  # each finished request's prefill chunks

    def step() -> list[Any]:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in times:
                times[o.request_id].append(now)
            if o.finished:
                chunks_of[o.request_id] = o.outputs[0].prefill_chunks
        return outs

    for _ in range(args.warm_steps):
        step()
    long_id = f"s{seed}-long"
    first_step = getattr(stats, "num_steps", len(stats.steps))
    arrival = time.perf_counter()
    engine.add_request(long_id, None, [rng.randrange(vocab) for _ in range(args.long_prompt)],
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first_token: float | None = None
    tail = 0
    while tail < args.tail_steps:
        outs = step()
        if first_token is None and any(o.request_id == long_id for o in outs):
            first_token = time.perf_counter()
        elif first_token is not None:
            tail += 1
    steps = [s for s in stats.steps if s.step >= first_step]
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    itls = [b - a for rid in ids for a, b in zip(times[rid], times[rid][1:]) if b > arrival]
    step_ms = [s.ms for s in steps if s.num_decodes]
    chunks = chunks_of.get(long_id, [])
    med_step = statistics.median(step_ms)
    return {"budget": budget, "max_step_tokens": max(s.num_tokens for s in steps), "long_chunks": len(chunks),
            "ttft_long_s": (first_token or arrival) - arrival, "max_itl_ms": max(itls) * 1000,
            "median_itl_ms": statistics.median(itls) * 1000, "median_step_ms": med_step,
            "max_over_median_step": max(itls) * 1000 / med_step, "steps_in_window": len(step_ms),
            "itl_ms_series": [round(x * 1000, 2) for x in sorted(itls)][-50:],
            "step_ms_series": [round(s.ms, 2) for s in steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-256")
    ap.add_argument("--long-prompt", type=int, default=16384)
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=5)
    ap.add_argument("--tail-steps", type=int, default=5)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 0], help="0: no chunking")
    ap.add_argument("--out", default="stall_free")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    single = -(-(args.long_prompt + args.decodes) // 64) * 64
    max_len = args.long_prompt + 16
    pool = -(-max_len // 16) + args.decodes * (-(-(args.decode_prompt + 4096) // 16)) + 16
    engine = LLMEngine.from_kwargs(model=model_dir, max_num_batched_tokens=single, max_model_len=max(max_len, 4352),
                                   num_kv_blocks=pool, enable_prefix_caching=False)
    budgets = [b or single for b in args.budgets]
    rows = []
    for i, b in enumerate(budgets):
        row = run_once(engine, b, args, vocab, seed=i)
        row["chunking"] = b < args.long_prompt
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("series")}, flush=True)
    save(args.out, {"benchmark": "stall_free", "model": args.model_name, "model_config": model_facts(model_dir),
                    "long_prompt": args.long_prompt, "decodes": args.decodes, "decode_prompt": args.decode_prompt,
                    "rows": rows, "goal": "with chunking, max ITL <= 2 x median step time"})


if __name__ == "__main__":
    main()
