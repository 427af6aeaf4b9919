"""The report section of benchmarks/spec_decode_mtp.py: decode tok/s with the model's own MTP drafts against
without, per model, batch and k."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table


def spec_decode_mtp(r: dict[str, Any]) -> list[str]:
    rows, m, f = r["rows"], r["machine"], r["facts"]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    names = [x["workload"].replace(", ", "\n").replace("dsv4 ", "dsv4\n") for x in rows]
    labels = [f"{name}\nbatch {x['batch']}, k {x['k']}" for name, x in zip(names, rows)]
    colors = {"predicted": "tab:blue", "random": "tab:green", "random, gate off": "tab:red",
              "dsv4 predicted": "tab:purple", "dsv4 random": "tab:olive"}
    ax.bar(range(len(rows)), [x["ratio"] for x in rows], color=[colors[x["workload"]] for x in rows])
    for i, x in enumerate(rows):
        ax.annotate(f"{x['ratio']:.2f}x\nlen {x['mean_acceptance_length']:.2f}", (i, x["ratio"]), ha="center",
                    va="bottom", fontsize=8)
    ax.axhline(1.0, color="k", ls=":", label="no drafts")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("decode tok/s, MTP drafts / none")
    ax.set_ylim(0, max(x["ratio"] for x in rows) * 1.3)
    ax.legend(fontsize=8)
    ax.set_title("Speculative decoding, the model's own MTP layer (Qwen3.5; DeepSeek-V4 at batch 1)")
    save_plot(fig, "spec_decode_mtp")
    lines = ["## Speculative decoding: the model's own MTP layer (Qwen3.5, DeepSeek-V4)", "",
             f"Reproduce: `{r['command']}`", "",
             f"Model `{r['model']}`: Qwen3.5, hidden {f['hidden_size']}, {f['num_hidden_layers']} layers (6 Gated "
             "DeltaNet, 2 gated full attention), 32K vocabulary, untied head, fp32, with one MTP layer "
             "(ladle.testing.mtp_checkpoint). In the predicted model the weights are rebuilt so that the MTP layer "
             "predicts the model: the head maps each token's embedding to a fixed successor (a random "
             f"permutation), every layer's output projections are scaled by {r['noise']}, and the MTP layer reads "
             "its token input almost alone; the model follows the successor map except where its layers' small "
             "contribution tips the argmax, which is where drafts are rejected. The random model keeps random "
             "weights and a random MTP layer, whose drafts are never accepted. The dsv4 rows are the same two "
             "constructions of `dsv4-512` (DeepSeek-V4: CSA, HCA and sliding layers, 16 experts of which 4 active, "
             f"4 hyper-connection streams; noise {r.get('dsv4_noise')}), at batch 1. Random 256-token prompts, "
             "greedy, "
             f"{r['tokens']} tokens a row. Decode tok/s of decode-only steps; the plain side is the same engine with "
             "its speculator and its runner's MTP drafter detached (no MTP layer runs), alternating turns, ratio "
             f"per turn then the median of {r['repeats']}. Tokens with drafts equal the plain run's in every turn "
             "(checked); each engine first decodes 384 tokens a row with drafts, so its step arms have settled. "
             f"Machine: {m['cpus']} CPUs, torch {m['torch']}, {m['threads']} thread(s).", "",
             "![spec_decode_mtp](benchmarks/plots/spec_decode_mtp.png)", ""]
    lines += table(["model", "batch", "k", "plain tok/s", "with drafts tok/s", "ratio", "per turn",
                    "accepted / drafted", "mean acceptance length"],
                   [[x["workload"], x["batch"], x["k"], f"{x['plain_tok_s']:.1f}", f"{x['spec_tok_s']:.1f}",
                     f"{x['ratio']:.2f}", " / ".join(f"{v:.2f}" for v in x["ratios"]),
                     f"{x['accepted']} / {x['drafted']}", f"{x['mean_acceptance_length']:.2f}"] for x in rows])
    return lines + [""]
