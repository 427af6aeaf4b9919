"""Tensor parallelism on this machine's CPUs (gloo): the same workload at tensor_parallel_size 1 and 2 (and any
others asked for), each in a fresh process, timed around `generate`; greedy tokens compared with TP 1; and what
rank 0 spends shipping each step's payload to the other ranks (pickling once, one socket write per rank).

On 2 cores TP 2 is expected to be slower than TP 1: each rank gets one core, the ranks meet at two all-reduces
per layer, and nothing is gained from splitting memory bandwidth that one core already saturates. It is
measured anyway, so the cost of the collectives is on record.

    python benchmarks/tensor_parallel.py --model-name qwen3-512 --sizes 1 2
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402


def run(model: str, tp: int, workload: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One engine at tensor_parallel_size tp, in this process."""
    from ladle import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=2048)
    startup = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    executor, stats = llm.engine.core.model_executor, llm.stats
    row = {"tensor_parallel_size": tp, "startup_s": startup, "generate_s": seconds, "steps": stats.num_steps,
           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "num_threads": llm.config.settings["num_threads"].value,
           "tokens": [o.outputs[0].token_ids for o in outs]}
    if tp > 1:
        row.update(broadcasts=executor.broadcasts,
                   broadcast_ms_per_step=1000 * executor.broadcast_s / executor.broadcasts,
                   broadcast_bytes_per_step=executor.broadcast_bytes / executor.broadcasts,
                   broadcast_share=executor.broadcast_s / seconds)
    llm.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--out", default="tensor_parallel")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one size, print its JSON row
    args = ap.parse_args()
    model = build_model(args.model_name)
    rng = random.Random(0)
    vocab = model_facts(model)["vocab_size"]
    workload = [([rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len))
                for _ in range(args.num_prompts)]
    if args.one:
        print("ROW " + json.dumps(run(model, int(args.one), workload)))
        return
    rows = []
    for tp in args.sizes:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(tp)], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROW "))[4:]))
        print({k: v for k, v in rows[-1].items() if k != "tokens"}, flush=True)
    base, base_tokens = rows[0], rows[0]["tokens"]
    for row in rows:
        row["speed_vs_tp1"] = base["generate_s"] / row["generate_s"]
        row["greedy_requests_identical_to_tp1"] = sum(a == b for a, b in zip(row.pop("tokens"), base_tokens))
    save(args.out, {"benchmark": "tensor_parallel", "model": args.model_name, "model_config": model_facts(model),
                    "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                 "output_len": args.output_len,
                                 "prompt_tokens": sum(len(p) for p, _ in workload),
                                 "output_tokens": sum(n for _, n in workload)},
                    "rows": rows})


if __name__ == "__main__":
    main()
