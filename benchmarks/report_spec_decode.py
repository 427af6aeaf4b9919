"""The report section of benchmarks/spec_decode.py: decode tok/s with n-gram drafts against without, per workload,
batch and k."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table


def spec_decode(r: dict[str, Any]) -> list[str]:
    rows, m, k = r["rows"], r["machine"], r["goal_k"]
    goal_rows = [x for x in rows if x["k"] == k]
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    labels = [f"{x['workload'].replace(', ', chr(10))}\nbatch {x['batch']}" for x in goal_rows]
    colors = {"copy": "tab:blue", "free": "tab:gray", "reject, gate on": "tab:green", "reject, gate off": "tab:red"}
    ax.bar(range(len(goal_rows)), [x["ratio"] for x in goal_rows], color=[colors[x["workload"]] for x in goal_rows])
    for i, x in enumerate(goal_rows):
        ax.annotate(f"{x['ratio']:.2f}x\nlen {x['mean_acceptance_length']:.2f}", (i, x["ratio"]), ha="center",
                    va="bottom", fontsize=8)
    ax.axhline(1.8, color="r", ls="--", label="goal, copy at batch 1: 1.8x")
    ax.axhline(0.97, color="k", ls=":", label="goal, no acceptance: 0.97x")
    ax.set_xticks(range(len(goal_rows)), labels, fontsize=7)
    ax.set_ylabel("decode tok/s, drafts / none")
    ax.set_ylim(0, max(x["ratio"] for x in goal_rows) * 1.25)
    ax.legend(fontsize=8)
    ax.set_title(f"Speculative decoding, n-gram drafts (k={k})")
    save_plot(fig, "spec_decode")
    f = r["facts"]
    lines = ["## Speculative decoding: n-gram drafts verified in the step", "",
             f"Reproduce: `{r['command']}`", "",
             f"Model `{r['model']}`: Mistral, hidden {f['hidden_size']}, {f['num_hidden_layers']} layers, a "
             f"{f['sliding_window']}-token sliding window, random weights, fp32 (about 100M parameters). Its next "
             "token depends on the last 192 tokens alone, so after a prompt that repeats a 256-token span of its own "
             "greedy text it continues that text, which prompt lookup proposes: the copy workload (a 32-token head, "
             "the model's 400-token greedy continuation, the span again). The free workload is random prompts of "
             "the same length, whose continuations repeat nothing. The reject workload is the gate's worst case, "
             "made on purpose: the free prompts with the proposer replaced by one that drafts k random tokens for "
             "every row at every step, with the gate on and forced off. Greedy, "
             f"{r['tokens']} tokens a row; drafts from n-grams of 2-4 tokens. Decode tok/s counts decode-only steps "
             "(each timed whole through the engine), so prefill is left out; plain and speculative engines in one "
             f"process, alternating turns, ratio per turn then the median of {r['repeats']}. The tokens with drafts "
             f"equal the plain run's in every turn (checked). Machine: {m['cpus']} CPUs, torch {m['torch']}, "
             f"{m['threads']} thread(s).", "",
             "![spec_decode](benchmarks/plots/spec_decode.png)", ""]
    lines += table(["workload", "batch", "k", "plain tok/s", "with drafts tok/s", "ratio", "accepted / drafted",
                    "mean acceptance length"],
                   [[x["workload"], x["batch"], x["k"], f"{x['plain_tok_s']:.1f}", f"{x['spec_tok_s']:.1f}",
                     f"{x['ratio']:.2f}", f"{x['accepted']} / {x['drafted']}", f"{x['mean_acceptance_length']:.2f}"]
                    for x in rows])
    lines.append("")
    for x in goal_rows:
        if x["workload"] == "copy" and x["batch"] == 1:
            lines.append(f"- **Goal: batch-1 decode >= 1.8x on the copy workload: {x['ratio']:.2f}x, "
                         f"{'met' if x['ratio'] >= 1.8 else 'missed'}.**")
        if x["workload"] in ("free", "reject, gate on"):
            lines.append(f"- **Goal: >= 0.97x where drafts are not accepted ({x['workload']}, batch {x['batch']}): "
                         f"{x['ratio']:.2f}x, {'met' if x['ratio'] >= 0.97 else 'missed'}.**")
    return lines + [""]
