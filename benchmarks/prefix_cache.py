"""Prefix caching: prefill time saved at 0 / 50 / 90 % hit rates, and its overhead when nothing hits.

Workload: N requests of L prompt tokens and one output token (prefill only). At hit rate h, every prompt
starts with the same h*L tokens, served once (untimed) before the timed batch, as a server sees a hot system
prompt; the rest of each prompt is unique. Each repeat uses a fresh prefix, so repeats never hit each other.
Per repeat, caching-off and caching-on runs are interleaved on the same prompts and their ratio is taken in
that repeat; the table reports medians over repeats, which keeps the ratios honest on a noisy shared CPU.

    python benchmarks/prefix_cache.py                 # demo model, built in a temp dir
    python benchmarks/prefix_cache.py --out benchmarks/results/prefix_cache.md
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ladle import LLM, SamplingParams
from ladle.demo import build_demo_model

HIT_RATES = (0.0, 0.5, 0.9)


def make_prompts(
    num_requests: int, prompt_len: int, hit_rate: float, vocab: int, seed: int
) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(int(prompt_len * hit_rate))]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(prompt_len - len(prefix))] for _ in range(num_requests)]
    return prefix, prompts


def timed_run(llm: LLM, prefix: list[int], prompts: list[list[int]]) -> tuple[float, float, int, int]:
    """Serves the prefix (untimed), then the batch; returns (CPU seconds, wall seconds, hit tokens, queried
    tokens). CPU time of this process is the primary measure: on a shared machine, wall time mostly
    measures the neighbours."""
    params = SamplingParams(temperature=0, max_tokens=1)
    if prefix:
        llm.generate({"prompt_token_ids": prefix}, params, use_tqdm=False)
    hits0, queries0 = llm.stats.prefix_cache_hits, llm.stats.prefix_cache_queries
    cpu, wall = time.process_time(), time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu, wall, llm.stats.prefix_cache_hits - hits0, llm.stats.prefix_cache_queries - queries0


def instrument(llm: LLM) -> list[float]:
    """Accumulate the seconds spent in prefix-cache bookkeeping: a direct, low-noise overhead measure."""
    total = [0.0]
    core = llm.engine.core
    for obj, name in ((core.kv, "get_computed_blocks"), (core.kv, "cache_full_blocks"),
                      (core.scheduler, "_prefix_in_flight")):
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, **kw):
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                total[0] += time.perf_counter() - start

        setattr(obj, name, timed)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the demo model in a temp dir)")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: CPU time then counts work, not spin-waiting)")
    ap.add_argument("--out", help="write the markdown section here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = args.model or build_demo_model(Path(tempfile.mkdtemp(prefix="ladle_demo_")) / "demo")
    kwargs = dict(max_num_batched_tokens=args.max_num_batched_tokens,
                  num_kv_blocks=-(-(args.num_requests + 1) * (args.prompt_len + 16) // 16) + 16)
    engines = {mode: LLM(model, enable_prefix_caching=mode == "on", **kwargs) for mode in ("off", "on")}
    bookkeeping = instrument(engines["on"])
    vocab = engines["on"].engine.core.hf_config.vocab_size
    warm = make_prompts(2, 256, 0.0, vocab, seed=-1)[1]
    for llm in engines.values():  # first calls pay allocator and kernel warm-up
        timed_run(llm, [], warm)

    times: dict[tuple[float, str], list[float]] = {(h, m): [] for h in HIT_RATES for m in ("off", "on")}
    walls: dict[tuple[float, str], list[float]] = {(h, m): [] for h in HIT_RATES for m in ("off", "on")}
    ratios: dict[float, list[float]] = {h: [] for h in HIT_RATES}
    measured_hit: dict[float, float] = {}
    bookkeeping_share: list[float] = []  # of the 0%-hit batches with caching on
    for rep in range(args.repeats):
        for h in HIT_RATES:
            prefix, prompts = make_prompts(args.num_requests, args.prompt_len, h, vocab, seed=1000 * rep + int(h * 100))
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")  # alternate who runs first
            got: dict[str, float] = {}
            for mode in order:
                spent = bookkeeping[0]
                seconds, wall, hits, queries = timed_run(engines[mode], prefix, prompts)
                if mode == "on" and h == 0.0:
                    bookkeeping_share.append((bookkeeping[0] - spent) / wall)
                got[mode] = seconds
                times[(h, mode)].append(seconds)
                walls[(h, mode)].append(wall)
                if mode == "on":
                    measured_hit[h] = hits / queries
            ratios[h].append(got["on"] / got["off"])

    lines = [
        "## Prefix caching",
        "",
        f"{args.num_requests} requests x {args.prompt_len} prompt tokens, 1 output token (prefill only), "
        f"max_num_batched_tokens={args.max_num_batched_tokens}; the shared prefix is served once before the "
        f"timed batch. CPU time of the batch (the process's, so neighbours on a shared machine do not count), "
        f"median of {args.repeats} repeats; the ratio is caching on / off measured in the same repeat (median "
        "of the per-repeat ratios). Wall time, median, in parentheses.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} thread(s); demo model (random weights).",
        "",
        "| target hit rate | measured hit rate | caching off, s (wall) | caching on, s (wall) | on / off | "
        "prefill time saved |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for h in HIT_RATES:
        r = statistics.median(ratios[h])
        lines.append(
            f"| {h:.0%} | {measured_hit[h]:.1%} | {statistics.median(times[(h, 'off')]):.3f} "
            f"({statistics.median(walls[(h, 'off')]):.3f}) | {statistics.median(times[(h, 'on')]):.3f} "
            f"({statistics.median(walls[(h, 'on')]):.3f}) | {r:.3f} | {1 - r:.1%} |"
        )
    r0 = sorted(ratios[0.0])
    lines += [
        "",
        f"Overhead at 0% hits (hashing every full block, one lookup per request): median on/off "
        f"{statistics.median(r0):.3f} ({statistics.median(r0) - 1:+.1%}); per-repeat ratios "
        f"{', '.join(f'{x:.3f}' for x in r0)}. Time inside the prefix-cache code itself (lookup, block "
        f"hashing, the in-flight check), timed directly: {statistics.median(bookkeeping_share):.2%} of the batch.",
        "",
        f"Reproduce: `python benchmarks/prefix_cache.py --repeats {args.repeats} --threads {args.threads}`",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
