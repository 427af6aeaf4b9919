"""Speculative decoding with the model's own MTP layer (method mtp): decode tok/s with and without its drafts,
batch 1 and 16, on a model whose MTP layer predicts it well and on one whose MTP layer is random (the gate's case).

The model is `qwen3.5-512` (6 Gated DeltaNet and 2 gated full-attention layers, hidden 512, 32K vocabulary,
random weights, fp32) given an MTP layer (ladle.testing.mtp_checkpoint). For the predicted model its weights are
rebuilt so that drafts are worth verifying: the head maps each token's embedding to a fixed successor (a random
permutation), every layer's output projections are scaled down to `--noise`, and the MTP layer reads its token
input almost alone. The target then follows the successor map except where its layers' small contribution tips
the argmax, which is where drafts are rejected; --noise sets how often (about 1 in 10 at 0.0027). The random
model keeps build_checkpoint's weights and a random MTP layer: its drafts are almost never accepted. The same two
constructions of `dsv4-512` (DeepSeek-V4: CSA, HCA and sliding layers, MoE, 4 hyper-connection streams) time its
MTP layer at batch 1 (its noise --dsv4-noise).
Prompts are random tokens; greedy, 128 tokens a row.

Before the turns each engine decodes --warmup tokens a row with drafts, so its step arms (which explore the slower
arm less often each time it loses) have settled as a long-running server's would. Decode tok/s counts
decode-only steps (benchmarks/spec_decode.py's decode_run). The plain side is the same engine
with its speculator and its runner's drafter detached, so it runs no MTP layer at all; plain and speculative turns
alternate, the ratio is taken per turn, then the median. The tokens with drafts equal the plain run's (checked).

    python benchmarks/spec_decode_mtp.py --out spec_decode_mtp
"""
from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import build_model, cache_dir, model_facts, save  # noqa: E402
from spec_decode import _decode_run, summarize  # noqa: E402
from ladle import LLM  # noqa: E402
from ladle.testing.mtp_checkpoint import add_mtp_layer, make_predictable  # noqa: E402

BASE = "qwen3.5-512"


def mtp_model(noise: float | None, base: str = BASE) -> str:
    """base with an MTP layer: predictable at this noise, or random (None); built once into the cache."""
    name = f"{base}-mtp-" + ("random" if noise is None else f"p{noise}")
    out = cache_dir() / name
    if not (out / "done").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(build_model(base), out)
        (out / "done").unlink()
        add_mtp_layer(str(out), seed=1)
        if noise is not None:
            make_predictable(str(out), noise, seed=2)
        (out / "done").write_text("ok\n")
    return str(out)


def decode_run(llm: LLM, prompts: list[list[int]], tokens: int, tag: str, drafts: bool) -> dict:
    """spec_decode's decode_run; drafts False detaches the speculator and the runner's MTP drafter too."""
    scheduler, runner = llm.engine.core.scheduler, llm.engine.core.model_executor.runner
    speculator, drafter = scheduler.speculator, runner.drafter
    if not drafts:
        scheduler.speculator, runner.drafter = None, None
    try:
        return _decode_run(llm, prompts, tokens, tag)
    finally:
        scheduler.speculator, runner.drafter = speculator, drafter


def force_drafts(llm: LLM) -> LLM:
    speculator = llm.engine.core.scheduler.speculator
    speculator.gate.allows = lambda rid, k, rows: k
    speculator.arms.drafts_now = lambda rows: True
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--k", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--noise", type=float, default=0.0027)
    ap.add_argument("--dsv4-noise", type=float, default=0.006, help="the predicted dsv4-512's noise")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=384, help="tokens a row decodes with drafts before the turns")
    ap.add_argument("--out", default="spec_decode_mtp")
    args = ap.parse_args()
    most = max(args.batches)
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(args.prompt)] for _ in range(most)]
    kw = dict(max_num_seqs=most, max_model_len=2048, max_num_batched_tokens=most * 512)
    models = {"predicted": mtp_model(args.noise), "random": mtp_model(None),
              "dsv4 predicted": mtp_model(args.dsv4_noise, "dsv4-512"), "dsv4 random": mtp_model(None, "dsv4-512")}
    models["random, gate off"] = models["random"]
    cases = [("predicted", b, k) for b in args.batches for k in args.k]
    cases += [("random", b, args.k[-1]) for b in args.batches]
    cases += [("random, gate off", b, args.k[-1]) for b in args.batches]
    cases += [("dsv4 predicted", 1, k) for k in args.k] + [("dsv4 random", 1, args.k[-1])]
    tags = iter(range(10**9))
    rows = []
    for workload, batch, k in cases:
        llm = LLM(models[workload], speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)
        if workload == "random, gate off":
            force_drafts(llm)
        batch_prompts = prompts[:batch]
        # Warm: shapes, the prefix cache for these prompts, and the drafts side's step arms, which settle over a
        # few hundred steps (ladle.engine.speculation.arms) as a server's do early in its life.
        decode_run(llm, batch_prompts, 8, f"w{next(tags)}", False)
        decode_run(llm, batch_prompts, args.warmup, f"w{next(tags)}", True)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for turn in range(args.repeats):
            for with_drafts in (False, True) if turn % 2 == 0 else (True, False):
                runs[with_drafts].append(decode_run(llm, batch_prompts, args.tokens, f"t{next(tags)}", with_drafts))
        llm.shutdown()
        rows.append(summarize(workload, batch, k, runs[False], runs[True]))
    save(args.out, {"model": BASE + " + MTP layer", "facts": model_facts(models["predicted"]), "noise": args.noise,
                    "dsv4_noise": args.dsv4_noise, "tokens": args.tokens, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
