"""Speculative decoding (n-gram drafts): decode tok/s with and without drafts, batch 1 and 16, on a workload whose
output copies its prompt and on one where drafts find nothing to copy (the gate's case).

The copying model is `mistral-768-w16` (about 100M parameters, random weights, fp32): Mistral with a 16-token
sliding window over 12 layers, so its next token depends on the last 192 tokens alone. Each copy prompt is a
32-token head, the model's own 400-token greedy continuation of it, then that text's tokens 40-295 again (256
tokens, longer than the model's reach): from there the model continues its own text, which is exactly what
prompt lookup proposes, as an agent re-emitting a file it was shown would. The free workload is random
688-token prompts: the model's greedy text then repeats no n-gram of its context, so drafts are rarely
proposed and never accepted. Both greedy, 128 tokens per row. The reject workload is the gate's worst case,
made on purpose: the free prompts with a proposer replaced by one that drafts k random tokens for every row at
every step (drafts that never match), with the gate on and, to show what it saves, forced off.

Decode tok/s counts the tokens of decode-only steps over their time (each step timed whole, through the engine
as LLM.generate drives it), so the prefill is not in it. The plain side is the same engine with its speculator
detached, so both sides share weights and memory: two engines in one process differed by 6-10% in decode speed
by the order they were built in alone (measured: the second one built is the faster, whichever is older). Plain
and speculative turns alternate; the ratio is taken per turn, then the median.

    python benchmarks/spec_decode.py --out spec_decode
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import build_model, model_facts, save  # noqa: E402
from ladle import LLM, SamplingParams  # noqa: E402

HEAD, TEXT, SPAN = 32, 400, (40, 296)


def spec(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def copy_prompts(model_dir: str, n: int, seed: int) -> list[list[int]]:
    """n prompts of head + greedy text + a 256-token span of that text again (see the module docstring)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(32000) for _ in range(HEAD)] for _ in range(n)]
    llm = LLM(model_dir, max_num_seqs=n, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=TEXT, ignore_eos=True)
    texts = [h + o.outputs[0].token_ids
             for h, o in zip(heads, llm.generate([{"prompt_token_ids": h} for h in heads], params, use_tqdm=False))]
    llm.shutdown()
    return [t + t[SPAN[0]: SPAN[1]] for t in texts]


def always_wrong(llm: LLM, gate: bool, seed: int) -> LLM:
    """llm with a proposer that drafts k random tokens every step; gate False: every draft is taken."""
    spec_ = llm.engine.core.scheduler.speculator
    rng = random.Random(seed)
    spec_.proposer.propose = lambda rid, tokens, k: tuple(rng.randrange(32000) for _ in range(k))
    if not gate:
        spec_.gate.allows = lambda rid, k, rows: k
        spec_.arms.drafts_now = lambda rows: True
    return llm


def decode_run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str, drafts: bool = True) -> dict:
    """One batch to the end: decode tok/s over its decode-only steps, and what its drafts did; drafts False:
    the same engine without its speculator (the plain side)."""
    scheduler = llm.engine.core.scheduler
    speculator = scheduler.speculator
    if not drafts:
        scheduler.speculator = None
    try:
        return _decode_run(llm, prompts, tokens, tag)
    finally:
        scheduler.speculator = speculator


def _decode_run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str) -> dict:
    engine, stats = llm.engine, llm.engine.core.stats
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    before = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, ids, params)
    outputs: dict[str, list[int]] = {}
    took, made = 0.0, 0
    while engine.has_unfinished_requests():
        steps, generated = stats.num_steps, stats.generation_tokens
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        seconds = time.perf_counter() - start
        if stats.num_steps > steps and stats.steps[-1].num_prefill_chunks == 0:
            took += seconds
            made += stats.generation_tokens - generated
    rows, drafted, accepted = (a - b for a, b in zip(
        (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens),
        before))
    return {"tok_s": made / took, "drafted": drafted, "accepted": accepted, "rows_with_drafts": rows,
            "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))]}


def summarize(workload: str, batch: int, k: int, plain: list[dict], fast: list[dict]) -> dict:
    """One case's row from its turns without drafts and with them (checked to make the same tokens), printed."""
    assert all(p["outputs"] == f["outputs"] for p, f in zip(plain, fast)), "drafts changed the tokens"
    drafted, accepted = sum(r["drafted"] for r in fast), sum(r["accepted"] for r in fast)
    with_drafts = sum(r["rows_with_drafts"] for r in fast)
    row = {"workload": workload, "batch": batch, "k": k,
           "plain_tok_s": statistics.median(r["tok_s"] for r in plain),
           "spec_tok_s": statistics.median(r["tok_s"] for r in fast),
           "ratio": statistics.median(f["tok_s"] / p["tok_s"] for p, f in zip(plain, fast)),
           "ratios": [f["tok_s"] / p["tok_s"] for p, f in zip(plain, fast)],
           "drafted": drafted, "accepted": accepted,
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           # Tokens a decode row with drafts produced per step: its accepted drafts and its own.
           "mean_acceptance_length": 1 + accepted / with_drafts if with_drafts else 1.0,
           "rows_with_drafts": with_drafts}
    print(f"{workload} batch {batch} k {k}: {row['plain_tok_s']:.1f} -> {row['spec_tok_s']:.1f} decode tok/s "
          f"({row['ratio']:.2f}x), accepted {accepted}/{drafted}, mean acceptance length "
          f"{row['mean_acceptance_length']:.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mistral-768-w16")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--k", nargs="+", type=int, default=[5], help="drafts per row; the first is the goal's")
    ap.add_argument("--sweep-k", nargs="*", type=int, default=[1, 3, 5], help="k at batch 1 on the copy workload")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="spec_decode")
    args = ap.parse_args()
    model_dir = build_model(args.model)
    most = max(args.batches)
    copy = copy_prompts(model_dir, most, seed=0)
    rng = random.Random(1)
    free = [[rng.randrange(32000) for _ in range(len(copy[0]))] for _ in range(most)]
    kw = dict(max_num_seqs=most, max_model_len=2048, max_num_batched_tokens=most * 1024)
    ks = sorted(set(args.k) | set(args.sweep_k))
    goal_k = args.k[0]
    engines: dict = {k: LLM(model_dir, speculative_config=spec(k), **kw) for k in ks}
    engines["reject, gate on"] = always_wrong(LLM(model_dir, speculative_config=spec(goal_k), **kw), True, 2)
    engines["reject, gate off"] = always_wrong(LLM(model_dir, speculative_config=spec(goal_k), **kw), False, 3)
    tags = iter(range(10**9))
    rows = []
    cases = [("copy", b, k, k) for b in args.batches for k in (ks if b == 1 else args.k)]
    cases += [("free", b, goal_k, goal_k) for b in args.batches]
    cases += [(name, b, goal_k, name) for name in ("reject, gate on", "reject, gate off") for b in args.batches]
    for workload, batch, k, key in cases:
        prompts = (copy if workload == "copy" else free)[:batch]
        llm = engines[key]
        for with_drafts in (False, True):  # warm: shapes, and the prefix cache for these prompts
            decode_run(llm, prompts, 8, f"w{next(tags)}", with_drafts)
        runs: dict[int, list[dict]] = {0: [], k: []}
        sides = [(0, False), (k, True)]
        for turn in range(args.repeats):
            for which, with_drafts in sides if turn % 2 == 0 else sides[::-1]:
                runs[which].append(decode_run(llm, prompts, args.tokens, f"t{next(tags)}", with_drafts))
        rows.append(summarize(workload, batch, k, runs[0], runs[k]))
    save(args.out, {"model": args.model, "facts": model_facts(model_dir), "tokens": args.tokens,
                    "repeats": args.repeats, "goal_k": goal_k, "rows": rows})


if __name__ == "__main__":
    main()
