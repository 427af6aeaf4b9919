"""Tiered MoE experts (ladle.experts): decode tok/s and prefill time per strategy, backing and cache size against
the fully resident model, with the cache's hit rate and the bytes it fetched.

The model is `qwen3-moe-512` (Qwen3-MoE, 8 layers of 16 experts, top 4, random weights, fp32): 128 routed experts
of 2.25 MiB, 288 MiB in all. A cache of 25% holds 32 of them, so the experts are 4x the cache. Each variant runs
in a process of its own (two engines in one process differed by their build order alone, see spec_decode.py),
the variants in turn, rotated each round (one turns --moe-prefetch on, off by default on CPU, to measure it); within a process the prefill and the decode run `--repeats` times and
give their medians, and each round's ratio against the resident run of the same round is taken, then the median
over rounds. Prefill: a 2048-token random prompt in chunks of 512, the time of its prefill steps. Decode: batch
1, a 32-token prompt and 64 new tokens, tok/s over the decode-only steps. The mmap tier reads the checkpoint's
file through the page cache, which is warm here after the first read (the machine's RAM holds the file): this
measures the cache and the copies, not a disk.

    python benchmarks/expert_tiering.py --out expert_tiering
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import build_model, model_facts, save  # noqa: E402

VARIANTS: dict[str, dict] = {
    "resident": {},
    "offload, mmap, 25%": {"moe_cache_fraction": 0.25, "moe_backing": "mmap"},
    "offload, mmap, 25%, prefetch": {"moe_cache_fraction": 0.25, "moe_backing": "mmap", "moe_prefetch": True},
    "offload, mmap, 12.5%": {"moe_cache_fraction": 0.125, "moe_backing": "mmap"},
    "offload, mmap, 50%": {"moe_cache_fraction": 0.5, "moe_backing": "mmap"},
    "hybrid, mmap, 25%": {"moe_cache_fraction": 0.25, "moe_backing": "mmap", "moe_strategy": "hybrid"},
    "offload, host, 25%": {"moe_cache_fraction": 0.25, "moe_backing": "host"},
    "cpu, mmap": {"moe_strategy": "cpu", "moe_backing": "mmap"},
}
PREFILL, CHUNK, PROMPT, NEW = 2048, 512, 32, 64


def worker(model_dir: str, kwargs: dict, repeats: int) -> dict:
    from ladle import LLM, SamplingParams

    llm = LLM(model_dir, max_model_len=4096, max_num_batched_tokens=CHUNK, max_num_seqs=4, **kwargs)
    stats = llm.engine.core.stats
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(32000) for _ in range(300)]}],
                 SamplingParams(max_tokens=4), use_tqdm=False)  # warm: shapes, threads, the page cache

    def steps_since(n: int, prefill: bool) -> list:
        return [s for s in list(stats.steps)[n:] if (s.num_prefill_chunks > 0) == prefill]

    prefill_s, decode_tok_s, tokens = [], [], []
    hits = misses = fetched = 0
    for r in range(repeats):
        prompt = [rng.randrange(32000) for _ in range(PREFILL)]
        n = len(stats.steps)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill_s.append(sum(s.ms for s in steps_since(n, True)) / 1000)
        short = [random.Random(100 + r).randrange(32000) for _ in range(PROMPT)]
        e = stats.experts
        before = (e.hits, e.misses, e.bytes_fetched) if e else (0, 0, 0)
        n = len(stats.steps)
        out = llm.generate([{"prompt_token_ids": short}], SamplingParams(temperature=0, max_tokens=NEW,
                                                                        ignore_eos=True), use_tqdm=False)
        decode = steps_since(n, False)
        decode_tok_s.append(len(decode) / (sum(s.ms for s in decode) / 1000))
        tokens.append(out[0].outputs[0].token_ids)
        if e:
            hits, misses, fetched = (hits + e.hits - before[0], misses + e.misses - before[1],
                                     fetched + e.bytes_fetched - before[2])
    settings = llm.engine.core.config.settings
    llm.shutdown()
    return {"prefill_s": statistics.median(prefill_s), "decode_tok_s": statistics.median(decode_tok_s),
            "hit_rate": hits / max(1, hits + misses), "mib_fetched_per_token": fetched / 2**20 / (repeats * NEW),
            "tokens": tokens, "slots": getattr(settings.get("tiered_experts"), "value", "")}


def run_variant(model_dir: str, name: str, repeats: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(VARIANTS[name]), "--model-dir", model_dir,
                          "--repeats", str(repeats)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-moe-512")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="expert_tiering")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.model_dir, json.loads(args.worker), args.repeats)))
        return
    model_dir = build_model(args.model)
    names = ["resident"] + [v for v in args.variants if v != "resident"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            runs[name].append(run_variant(model_dir, name, args.repeats))
            x = runs[name][-1]
            print(f"round {r} {name}: prefill {x['prefill_s']:.2f} s, decode {x['decode_tok_s']:.1f} tok/s, "
                  f"hit rate {x['hit_rate']:.2f}", flush=True)
    rows = []
    for name in names:
        mine, base = runs[name], runs["resident"]
        rows.append({
            "variant": name, "kwargs": VARIANTS[name], "slots": mine[0]["slots"],
            "prefill_s": statistics.median(x["prefill_s"] for x in mine),
            "decode_tok_s": statistics.median(x["decode_tok_s"] for x in mine),
            "prefill_ratio": statistics.median(b["prefill_s"] / x["prefill_s"] for x, b in zip(mine, base)),
            "decode_ratio": statistics.median(x["decode_tok_s"] / b["decode_tok_s"] for x, b in zip(mine, base)),
            "hit_rate": statistics.median(x["hit_rate"] for x in mine),
            "mib_fetched_per_token": statistics.median(x["mib_fetched_per_token"] for x in mine),
            "same_tokens": all(x["tokens"] == b["tokens"] for x, b in zip(mine, base)),
        })
        print(rows[-1], flush=True)
    save(args.out, {"model": args.model, "facts": model_facts(model_dir), "rounds": args.rounds,
                    "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
