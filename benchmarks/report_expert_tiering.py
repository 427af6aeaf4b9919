"""The report section of benchmarks/expert_tiering.py: decode and prefill of tiered experts against the resident
model, per strategy, backing and cache size."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table

GOAL_DECODE, GOAL_PREFILL = 0.5, 0.8
GOAL_VARIANT = "offload, mmap, 25%"
STREAMING = "offload, mmap, 25%, prefetch"


def expert_tiering(r: dict[str, Any]) -> list[str]:
    rows, m, f = r["rows"], r["machine"], r["facts"]
    tiered = [x for x in rows if x["variant"] != "resident"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    at = range(len(tiered))
    ax.bar([i - 0.2 for i in at], [x["decode_ratio"] for x in tiered], 0.4, label="decode tok/s")
    ax.bar([i + 0.2 for i in at], [x["prefill_ratio"] for x in tiered], 0.4, label="prefill speed (1 / time)")
    ax.axhline(GOAL_DECODE, color="tab:blue", ls=":", label=f"goal, decode at 25%: {GOAL_DECODE}x")
    ax.axhline(GOAL_PREFILL, color="tab:orange", ls="--", label=f"goal, prefill: {GOAL_PREFILL}x")
    ax.set_xticks(list(at), [x["variant"].replace(", ", "\n") for x in tiered], fontsize=7)
    ax.set_ylabel("tiered / resident")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Tiered MoE experts against the resident model (qwen3-moe-512, CPU)")
    save_plot(fig, "expert_tiering")
    lines = ["## Tiered MoE experts: a cache of expert slots, the rest in host memory or the checkpoint's files", "",
             f"Reproduce: `{r['command']}`", "",
             f"Model `{r['model']}`: Qwen3-MoE, hidden {f['hidden_size']}, {f['num_hidden_layers']} layers of "
             f"{f.get('num_experts', 16)} experts (top {f.get('num_experts_per_tok', 4)}), random weights, fp32: 128 "
             "routed experts of 2.25 MiB (288 MiB). A 25% cache holds 32, so the experts are 4x the cache. In-place reads "
             "(cpu, hybrid) go to scratch memory and are not counted as fetched. Each "
             "variant in a process of its own, the variants in turn, rotated each round; per process the medians of "
             f"{r['repeats']} prefills (a 2,048-token prompt in 512-token chunks, its prefill steps' time) and "
             f"{r['repeats']} decodes (batch 1, 64 tokens, decode-only steps); each round's ratio against the "
             f"resident run of that round, then the median of {r['rounds']} rounds. The mmap tier reads through a "
             "warm page cache (the file fits this machine's RAM): this measures the cache and its copies, not a "
             f"disk. Machine: {m['cpus']} CPUs, torch {m['torch']}.", "",
             "![expert_tiering](benchmarks/plots/expert_tiering.png)", ""]
    lines += table(["variant", "device slots", "decode tok/s", "decode / resident", "prefill s",
                    "prefill speed / resident", "hit rate (decode)", "MiB fetched into slots per decode token",
                    "tokens = resident"],
                   [[x["variant"], x["slots"].split(" on the")[0] or "all", f"{x['decode_tok_s']:.1f}",
                     f"{x['decode_ratio']:.2f}", f"{x['prefill_s']:.2f}", f"{x['prefill_ratio']:.2f}",
                     f"{x['hit_rate']:.2f}", f"{x['mib_fetched_per_token']:.1f}", "yes" if x["same_tokens"] else "NO"]
                    for x in rows])
    goal = next((x for x in rows if x["variant"] == GOAL_VARIANT), None)
    streaming = next((x for x in rows if x["variant"] == STREAMING), None)
    lines.append("")
    if goal is not None and streaming is not None:
        lines += [f"- **Goal: decode >= {GOAL_DECODE}x resident with the mmap tier at a 25% cache: "
                  f"{goal['decode_ratio']:.2f}x, {'met' if goal['decode_ratio'] >= GOAL_DECODE else 'missed'}** "
                  f"(with prefetch: {streaming['decode_ratio']:.2f}x).",
                  f"- **Goal: prefill >= {GOAL_PREFILL}x resident with streaming (--moe-prefetch, the next layer's "
                  f"experts fetched while one computes): {streaming['prefill_ratio']:.2f}x, "
                  f"{'met' if streaming['prefill_ratio'] >= GOAL_PREFILL else 'missed'}** (without: "
                  f"{goal['prefill_ratio']:.2f}x)."]
    return lines + [""]
