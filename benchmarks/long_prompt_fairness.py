"""Short requests beside long prefills: time to first token of short requests arriving (Poisson) while a long
prompt prefills, and the long prompt's own time, with the default partial-prefill settings ("after") and with
max_num_partial_prefills=1 ("before": one prefill at a time, as the scheduler ran before the caps existed).

The engine core is driven as the server's engine process drives it: a short request is added once its arrival
time has passed, and every step's outputs are timestamped. Per long-prompt length: the long prompt alone, then
with short requests arriving at --rate per second over the long prompt's alone time, once per variant (one
engine per variant, only --max-num-batched-tokens and --max-model-len set, the prefix cache reset before
each run).

    python benchmarks/long_prompt_fairness.py --long-lens 30000 100000
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_model, model_facts, save  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402

VARIANTS = {"after": {}, "before": {"max_num_partial_prefills": 1}}


def drive(core: Any, long_ids: list[int], shorts: list[tuple[float, list[int]]], new_long: int,
          new_short: int) -> dict[str, Any]:
    """Run the long prompt and the shorts (arrival offset in s, prompt) to completion; times in s from start."""
    assert core.reset_prefix_cache()
    params = {"long": SamplingParams(temperature=0, max_tokens=new_long, ignore_eos=True)}
    pending = sorted(shorts)
    start = time.perf_counter()
    core.add_request(core.make_request("long", long_ids, params["long"]))
    arrived, first, done = {"long": 0.0}, {}, {}
    short_params = SamplingParams(temperature=0, max_tokens=new_short, ignore_eos=True)
    while pending or core.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, ids = pending.pop(0)
            rid = f"short{len(arrived)}"
            core.add_request(core.make_request(rid, ids, short_params))
            arrived[rid] = at
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outs = core.step()
        now = time.perf_counter() - start
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
            if o.finish_reason:
                done[o.request_id] = now
    ttft = [first[r] - arrived[r] for r in arrived if r != "long"]
    e2e = [done[r] - arrived[r] for r in arrived if r != "long"]
    return {"long_s": done["long"], "long_ttft_s": first["long"], "shorts": len(ttft),
            "short_ttft_ms": _dist(ttft), "short_e2e_ms": _dist(e2e)}


def _dist(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(x * 1000 for x in xs)
    return {"p50": round(statistics.median(xs), 1), "p99": round(xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))], 1),
            "max": round(xs[-1], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-256-128k")
    ap.add_argument("--long-lens", type=int, nargs="+", default=[30000, 100000])
    ap.add_argument("--rate", type=float, default=1.0, help="short requests per second")
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--short-out", type=int, default=16)
    ap.add_argument("--long-out", type=int, default=4)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--before-lens", type=int, nargs="*", default=None,
                    help="long lengths to run the 'before' variant on (default: all)")
    ap.add_argument("--out", default="long_prompt_fairness")
    args = ap.parse_args()
    model_dir = build_model(args.model_name)
    vocab = model_facts(model_dir)["vocab_size"]
    rng = random.Random(0)
    longs = {n: [rng.randrange(vocab) for _ in range(n)] for n in args.long_lens}
    rows: list[dict[str, Any]] = []
    alone: dict[int, float] = {}
    for variant, extra in VARIANTS.items():
        llm = LLM(model_dir, max_num_batched_tokens=args.budget, max_model_len=max(args.long_lens) + 64, **extra)
        settings = {k: s.value for k, s in llm.config.settings.items() if "partial" in k or "long_prefill" in k}
        for n in args.long_lens:
            if variant == "before" and args.before_lens is not None and n not in args.before_lens:
                continue
            if n not in alone:
                alone[n] = drive(llm.engine.core, longs[n], [], args.long_out, args.short_out)["long_s"]
                print(f"long {n} alone: {alone[n]:.1f} s", flush=True)
            arr, t = random.Random(n), 0.5
            shorts = []
            while (t := t + arr.expovariate(args.rate)) < alone[n]:
                shorts.append((t, [arr.randrange(vocab) for _ in range(args.short_len)]))
            res = drive(llm.engine.core, longs[n], shorts, args.long_out, args.short_out)
            res |= {"variant": variant, "settings": settings, "long_tokens": n, "long_alone_s": round(alone[n], 2),
                    "long_slowdown": round(res["long_s"] / alone[n], 3)}
            res["long_s"], res["long_ttft_s"] = round(res["long_s"], 2), round(res["long_ttft_s"], 2)
            print(res, flush=True)
            rows.append(res)
        del llm
        gc.collect()
    save(args.out, {"benchmark": "long_prompt_fairness", "model": args.model_name,
                    "model_config": model_facts(model_dir), "budget": args.budget, "rate": args.rate,
                    "short_len": args.short_len, "short_out": args.short_out, "rows": rows})


if __name__ == "__main__":
    main()
