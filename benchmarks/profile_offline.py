"""Where the offline time goes: torch.profiler op totals for ladle and HF generate on one workload.

Runs the offline_throughput workload (smaller by default) once per engine under torch.profiler (CPU
activity, op-level) and records the top ops by self CPU time, grouped so the engines compare: matmuls
(aten::mm / addmm / bmm / linear), attention kernels, copies and indexing. For ladle it also splits the
core's recorded step time into steps with a prefill chunk and pure decode steps.

    python benchmarks/profile_offline.py --num-prompts 12
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402
from offline_throughput import load_hf, run_hf_generate  # noqa: E402

from ladle.frontend.llm_engine import LLMEngine  # noqa: E402
from ladle.entrypoints.bench import random_workload, run_ladle_offline  # noqa: E402

GROUPS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
          "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
          "copy / index / cat": ("aten::copy_", "aten::index", "aten::index_select", "aten::cat", "aten::index_copy_",
                                 "aten::clone", "aten::contiguous")}


def profiled(fn: Callable[[], dict[str, Any]], top: int) -> dict[str, Any]:
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    wall = time.perf_counter() - start
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    groups = {g: sum(e.self_cpu_time_total for e in ops if e.key in names) / 1e6 for g, names in GROUPS.items()}
    return {"wall_s": wall, "profiled_op_s": total, "groups_s": groups, "duration_s": result["duration_s"],
            "top": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in ops[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="profile_offline")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    work = random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, seed=0)
    warm = random_workload(2, (args.input_len[0], min(args.input_len[1], 128)), (1, min(args.output_len[1], 4)),
                           vocab, seed=-1)
    engine = LLMEngine.from_kwargs(model=model_dir, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_model_len=args.input_len[1] + args.output_len[1])
    hf = load_hf(model_dir)
    pad = hf.generation_config.pad_token_id or 0
    run_ladle_offline(engine, warm)
    run_hf_generate(hf, warm, args.hf_batch_size, pad)
    first = engine.core.stats.num_steps
    ladle = profiled(lambda: run_ladle_offline(engine, work), args.top)
    steps = [s for s in engine.core.stats.steps if s.step >= first]
    ladle["prefill_steps"] = {"count": sum(1 for s in steps if s.num_prefill_chunks),
                              "s": sum(s.ms for s in steps if s.num_prefill_chunks) / 1000}
    ladle["decode_steps"] = {"count": sum(1 for s in steps if not s.num_prefill_chunks),
                             "s": sum(s.ms for s in steps if not s.num_prefill_chunks) / 1000}
    hf_gen = profiled(lambda: run_hf_generate(hf, work, args.hf_batch_size, pad), args.top)
    batches = [range(b, min(b + args.hf_batch_size, len(work.prompts)))
               for b in range(0, len(work.prompts), args.hf_batch_size)]
    padded_in = sum(max(len(work.prompts[i]) for i in r) * len(r) for r in batches)
    padded_out = sum(max(work.output_lens[i] for i in r) * len(r) for r in batches)
    for name, r in (("ladle", ladle), ("hf_generate", hf_gen)):
        print(f"== {name}: {r['duration_s']:.1f} s ({r['profiled_op_s']:.1f} s in ops) ==")
        for g, s in r["groups_s"].items():
            print(f"  {g:<20} {s:7.2f} s")
        for t in r["top"]:
            print(f"  {t['op']:<55} {t['self_s']:7.2f} s {t['calls']:>7} calls")
    print(f"tokens computed: ladle {work.num_prompt_tokens} prompt + {work.num_output_tokens} output; "
          f"HF generate {padded_in} padded prompt + {padded_out} padded output")
    save(args.out, {"benchmark": "profile_offline", "model": args.model_name, "model_config": model_facts(model_dir),
                    "num_prompts": args.num_prompts, "ladle": ladle, "hf_generate": hf_gen,
                    "tokens": {"prompt": work.num_prompt_tokens, "output": work.num_output_tokens,
                               "hf_padded_prompt": padded_in, "hf_padded_output": padded_out}})


if __name__ == "__main__":
    main()
