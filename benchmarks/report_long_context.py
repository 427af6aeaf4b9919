"""The report section of benchmarks/long_context.py: TTFT by prompt length, decode at depth and chunking's cost
at depth, ladle beside vLLM's CPU build, with the goals of issue 39."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table


def long_context(r: dict[str, Any]) -> list[str]:
    s, engines = r["summary"], r["engines"]
    ttft = {(x["engine"], x["tokens"]): x for x in s if x["chunk"] == r["chunk"]}
    decode = {(x["engine"], x["tokens"]): x for x in s if x["decode_tok_s"] is not None}
    chunked = {(x["engine"], x["chunk"]): x for x in s if x["tokens"] == r["chunk_at"]}
    lengths = sorted({n for _, n in ttft})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for e in engines:
        axes[0].plot(lengths, [ttft[(e, n)]["ttft_s"] if (e, n) in ttft else None for n in lengths], "o-", label=e)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("TTFT s (median)")
    axes[0].legend()
    chunks = sorted({c for _, c in chunked})
    for i, e in enumerate(engines):
        axes[1].bar([j + 0.4 * i for j in range(len(chunks))],
                    [chunked[(e, c)]["ttft_s"] if (e, c) in chunked else 0 for c in chunks], 0.4, label=e)
    axes[1].set_xticks([j + 0.2 for j in range(len(chunks))], [str(c) for c in chunks])
    axes[1].set_xlabel(f"chunk size ({r['chunk_at']:,}-token prompt)")
    axes[1].set_ylabel("TTFT s")
    axes[1].legend()
    save_plot(fig, "long_context")
    cfg, m = r["model_config"], r["machine"]
    lines = ["## Long contexts beside vLLM (CPU build)", "", f"Reproduce: `{r['command']}`", "",
             f"Model `{r['model']}` (hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
             f"{cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} heads x {cfg.get('head_dim')}), "
             f"random weights, fp32, every prompt fresh random tokens; each engine and chunk size a fresh process, engines "
             f"alternating, medians of {r['repeats']} repeat(s). TTFT and decode runs at chunk {r['chunk']:,} "
             f"(max_num_batched_tokens); decode tok/s of one request over {r['decode_tokens']} tokens at the given "
             f"context (its prompt a second time, every full block from the prefix cache). Peak RSS is the process's (weights and KV pool included). Machine: {m['cpus']} CPUs, torch "
             f"{m['torch']}.", "", "![long_context](benchmarks/plots/long_context.png)", ""]
    head = ["prompt tokens"] + [f"{e} TTFT s" for e in engines] + [f"{e} peak RSS MiB" for e in engines]
    lines += table(head, [[f"{n:,}"] + [ttft[(e, n)]["ttft_s"] if (e, n) in ttft else "-" for e in engines]
                          + [ttft[(e, n)]["peak_rss_mib"] if (e, n) in ttft else "-" for e in engines]
                          for n in lengths]) + [""]
    if decode:
        contexts = sorted({n for _, n in decode})
        lines += table(["context"] + [f"{e} decode tok/s" for e in engines],
                       [[f"{n:,}"] + [decode[(e, n)]["decode_tok_s"] if (e, n) in decode else "-" for e in engines]
                        for n in contexts]) + [""]
    if chunked:
        lines += table(["chunk"] + [f"{e} TTFT s" for e in engines],
                       [[c] + [chunked[(e, c)]["ttft_s"] if (e, c) in chunked else "-" for e in engines]
                        for c in chunks]) + [""]
    return lines
