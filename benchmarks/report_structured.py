"""The report section of benchmarks/structured.py: constrained decode against unconstrained, per vocabulary and
batch, and grammar compile times."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table


def structured(r: dict[str, Any]) -> list[str]:
    rows, m = r["rows"], r["machine"]
    vocabs = sorted({x["vocab"] for x in rows})
    batches = sorted({x["batch"] for x in rows})
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    width = 0.8 / len(vocabs)
    for i, v in enumerate(vocabs):
        got = {x["batch"]: x["ratio"] for x in rows if x["vocab"] == v}
        ax.bar([j + i * width for j in range(len(batches))], [got.get(b, 0) for b in batches], width,
               label=f"vocab {v:,}")
    ax.axhline(0.9, color="r", ls="--", label="goal at batch 16: 0.9")
    ax.set_xticks([j + width * (len(vocabs) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("constrained / unconstrained decode tok/s")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8)
    ax.set_title("Structured outputs: decode throughput kept")
    save_plot(fig, "structured")
    goal = [x for x in rows if x["batch"] == 16]
    models = ", ".join(f"`{name}` (vocab {f['vocab_size']:,})" for name, f in r["models"].items())
    lines = ["## Structured outputs: the cost of a grammar per token", "",
             f"Reproduce: `{r['command']}`", "",
             f"Models {models}: Qwen3, hidden 512, 8 layers, random weights, fp32; the 152K tokenizer is the demo "
             f"BPE grown to Qwen's vocabulary size with ordinary merges. Every row of the batch decodes "
             f"{r['tokens']} tokens (greedy) under one JSON schema, an array of small objects with minItems "
             "10,000, so no row completes early and the matchers pass through string, integer, boolean and "
             "separator states; the peer is the same batch unconstrained, in alternating turns. Decode tok/s is "
             f"the batch over the median full-decode step (each step timed whole), median of {r['repeats']} "
             "turns; ratio and overhead per turn (its two runs back to back, in alternating order), then the "
             f"median. Machine: {m['cpus']} CPUs, torch {m['torch']} with {m['threads']} thread(s).", "",
             "![structured](benchmarks/plots/structured.png)", ""]
    lines += table(["vocab", "batch", "unconstrained tok/s", "constrained tok/s", "ratio", "overhead ms/step",
                    "of which mask fill ms/step"],
                   [[f"{x['vocab']:,}", x["batch"], x["unconstrained_tok_s"], x["constrained_tok_s"],
                     f"{x['ratio']:.2f}", f"{x['overhead_ms_per_step']:.2f}", f"{x['mask_fill_ms_per_step']:.2f}"]
                    for x in rows])
    lines.append("")
    for x in goal:
        met = "met" if x["ratio"] >= 0.9 else "missed"
        lines.append(f"- **Goal: constrained decode >= 0.9x unconstrained at batch 16, vocab {x['vocab']:,}: "
                     f"{x['ratio']:.2f}x, {met}.**")
    lines += ["", "Grammar compile, cold (ms; the tokenizer's build for llguidance happens once per engine, on "
              "the first constrained request, off the step loop):", ""]
    kinds = list(next(iter(r["compile_ms"].values())))
    lines += table(["compile", *[f"vocab {r['models'][n]['vocab_size']:,}" for n in r["compile_ms"]]],
                   [[k, *[f"{r['compile_ms'][n][k]:.1f}" for n in r["compile_ms"]]] for k in kinds])
    return lines + [""]
