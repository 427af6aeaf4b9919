"""Host time per decode step: what a GPU replaying a CUDA graph waits for between two steps.

The whole `EngineCore.step()` of N running decodes with the model replaced by a stub (hidden states of
zeros, fixed random logits): scheduling, inputs, sampling and output bookkeeping, everything but the model.
On CPU sampling is host work too, so the kinds of requests matter: greedy, random (temperature 0.8, top-k
50, top-p 0.9), seeded random, and penalties (repetition 1.1, frequency 0.2, greedy). One thread.

With --compare-with TREE each round runs this script's worker once against TREE (another checkout's ladle,
e.g. `git worktree add /tmp/base <commit>`) and once against this one, in turns whose order flips each
round, so machine drift falls on both; every cell is the median over rounds of the median of 5 timed runs
of 20 steps (5 at the real vocabulary).

    git worktree add /tmp/base <before> && \\
    OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --compare-with /tmp/base \\
        --out benchmarks/results/host_overhead.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# (vocabulary, decode batches, steps per timed run): a small vocabulary shows the bookkeeping, a real one
# (Qwen3's) what CPU sampling costs on top; full sorts of 150K-token rows make its steps long, so fewer.
TABLES = ((512, (1, 64, 256), 20), (151936, (1, 16), 5))
KINDS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8, top_k=50, top_p=0.9),
    "seeded": dict(temperature=0.8, top_p=0.9, seed=1),
    "penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2),
}


def median_ms(fn: Callable[[], object], steps: int = 20, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def worker(batches: list[int], context: int, vocab: int, kinds: list[str], steps: int) -> dict:
    """{kind: {batch: ms per step}} for the ladle on sys.path (this runs in a subprocess)."""
    import torch
    from transformers import Qwen3Config

    try:
        from ladle.config.engine_args import EngineArgs
    except ImportError:  # a tree from before ladle/config/ (--compare-with an older checkout)
        from ladle.config import EngineArgs  # type: ignore[no-redef]
    from ladle.engine.core import EngineCore
    from ladle.sampling_params import SamplingParams

    torch.set_num_threads(1)
    out: dict = {kind: {} for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        # A config alone (random weights, load_format="dummy"): any vocabulary, no tokenizer to train.
        Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4 * context,
                    tie_word_embeddings=True, eos_token_id=vocab - 1,
                    architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp)
        for batch in batches:
            per_request = -(-2 * context // 16)
            args, explicit = EngineArgs.from_kwargs(model=tmp, max_num_batched_tokens=8192, max_num_seqs=batch,
                                                    num_kv_blocks=batch * per_request, max_model_len=4 * context,
                                                    load_format="dummy")
            core = EngineCore(args, explicit)
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 4
            # (the runner sits behind the executor seam since the layered package; before it, on the core)
            model = getattr(core, "model_executor", core).runner.model
            model.forward = lambda ids, *_: torch.zeros(ids.shape[0], 64)
            model.compute_logits = lambda hidden: logits[: hidden.shape[0]]
            for kind in kinds:
                params = SamplingParams(max_tokens=context, ignore_eos=True, **KINDS[kind])
                rids = [f"{kind}{i}" for i in range(batch)]
                for i, rid in enumerate(rids):
                    core.add_request(core.make_request(rid, [1 + (i + j) % 400 for j in range(context)], params))
                while any(r.is_prefilling for r in core.scheduler.running) or core.scheduler.waiting:
                    core.step()
                out[kind][batch] = round(median_ms(core.step, steps), 3)
                core.abort_requests(rids)
                core.step()  # the engine goes idle: the runner forgets them
    return out


def compare(before: str, rounds: int, batches: list[int], context: int, vocab: int, kinds: list[str],
            steps: int) -> dict:
    """Medians over rounds of each tree's worker, alternating which runs first."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {"before": before, "after": here}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            env = dict(os.environ, PYTHONPATH=trees[name], OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--worker", "--batches", *map(str, batches), "--context", str(context),
                   "--vocab", str(vocab), "--steps", str(steps), "--kinds", *kinds]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=trees[name])
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    return {name: {k: {b: statistics.median(run[k][str(b)] for run in rs) for b in batches} for k in kinds}
            for name, rs in runs.items()}


def markdown(result: dict, batches: list[int], context: int, vocab: int, kinds: list[str], rounds: int,
             before: str) -> list[str]:
    lines = [f"Vocabulary {vocab:,}, context {context:,}: ms per step (median of {rounds} rounds; before: "
             f"`{before}`)", "", "| requests | " + " | ".join(f"batch {b}: before / after (ratio)" for b in batches)
             + " |", "|---|" + "---:|" * len(batches)]
    for k in kinds:
        cells = [f"{result['before'][k][b]:.2f} / {result['after'][k][b]:.2f} "
                 f"({result['after'][k][b] / result['before'][k][b]:.2f}x)" for b in batches]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compare-with", default=None, help="another checkout's root, measured as 'before'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--out", default=None, help="write the markdown section here")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.batches, a.context, a.vocab, a.kinds, a.steps)))
        return
    if a.compare_with is None:
        for vocab, batches, steps in TABLES:
            print(vocab, worker(list(batches), a.context, vocab, a.kinds, steps), flush=True)
        return
    lines = ["## Host time per decode step", "",
             "The whole `EngineCore.step()` with the model stubbed out (scheduling, inputs, sampling, "
             "bookkeeping), one thread: what the device waits for between two CUDA-graph replays, and on CPU "
             "what every step costs besides the model.", ""]
    for vocab, batches, steps in TABLES:
        result = compare(a.compare_with, a.rounds, list(batches), a.context, vocab, a.kinds, steps)
        lines += markdown(result, list(batches), a.context, vocab, a.kinds, a.rounds, a.compare_with) + [""]
    lines += ["Reproduce: `git worktree add /tmp/base <before> && OMP_NUM_THREADS=1 python "
              "benchmarks/host_overhead.py --compare-with /tmp/base --out benchmarks/results/host_overhead.md`", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
