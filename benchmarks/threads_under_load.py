"""Offline generation time by torch thread count, on a quiet machine and beside a busy neighbour (one process
spinning on one core), each configuration in a fresh process. Writes benchmarks/results/threads.md.

Why: torch's thread team meets at a barrier after every parallel op; when another process takes one of the
team's cores, the whole team waits for the preempted thread. This measures what that costs here, and what
pinning each run to its CPUs (the engine's `num_threads`, or `ladle serve`'s reserved CPU) changes.

    python benchmarks/threads_under_load.py --model-name qwen3-256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_model, command, machine  # noqa: E402

RUN = """
import json, os, sys, time
from ladle import LLM, SamplingParams
threads = int(sys.argv[2])
if sys.argv[3] == "process":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
# Per-thread binding narrows the main thread's mask to one CPU, so the count comes from OMP_NUM_THREADS there.
llm = LLM(sys.argv[1], max_num_batched_tokens=256, **({} if "OMP_NUM_THREADS" in os.environ else {"num_threads": threads}))
prompts = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(64 + 16 * i)]} for i in range(16)]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], params, use_tqdm=False)
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"s": time.perf_counter() - start}))
"""


BINDINGS = {"none": "threads float", "process": "the process pinned to its first num_threads CPUs",
            "per-thread": "each OpenMP thread pinned to one CPU (GOMP_CPU_AFFINITY, as vLLM's CPU backend binds)"}


def run(model_dir: str, threads: int, binding: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY")}
    if binding == "per-thread":
        env["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", RUN, model_dir, str(threads), binding],
                         capture_output=True, text=True, env=env, timeout=1200, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-256")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    cpus = len(os.sched_getaffinity(0))
    configs = [(cpus, "none"), (cpus, "per-thread"), (1, "none"), (1, "process")] if cpus > 1 else [(1, "none")]
    rows = []
    for busy in (False, True):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads, binding in configs:
                times = [run(model_dir, threads, binding) for _ in range(args.repeats)]
                rows.append((busy, threads, binding, statistics.median(times)))
                print(rows[-1], flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
    quiet = {(t, p): s for b, t, p, s in rows if not b}
    lines = ["## CPU threads under load", "", f"Reproduce: `{command()}`", "",
             f"16 prompts of 64-304 tokens, 64 output tokens each, greedy, `{args.model_name}`, fp32, one fresh "
             f"process per run (median of {args.repeats}); the neighbour is one Python process spinning "
             f"`while True: pass`, unpinned. Machine: {machine()['cpus']} CPUs, torch {machine()['torch']}.", "",
             "Bindings: " + "; ".join(f"`{k}`: {v}" for k, v in BINDINGS.items()) + ".", "",
             "| neighbour | num_threads | binding | seconds | vs the same run, quiet |", "|---:|---:|---:|---:|---:|"]
    for busy, threads, binding, s in rows:
        lines.append(f"| {'busy' if busy else 'quiet'} | {threads} | {binding} | {s:.2f} | "
                     f"{s / quiet[(threads, binding)]:.2f}x |")
    (RESULTS / "threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
