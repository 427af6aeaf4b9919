"""The report section of benchmarks/agent_turns.py: tokens computed and TTFT per turn, prefix caching on vs off."""
from __future__ import annotations

import statistics
from typing import Any

from report_common import plt, save_plot, table


def agent_turns(r: dict[str, Any]) -> list[str]:
    models = r["models"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for name, runs in models.items():
        on, off = runs["on"], runs.get("off", [])
        later = on[1:]
        worst = max(t["computed"] / t["new"] for t in later) if later else float("nan")
        ttft_on = [t["ttft_s"] * 1000 for t in later]
        ttft_off = [t["ttft_s"] * 1000 for t in off[1:]]
        rows.append([name, f"{worst:.2f}", f"{sum(t['computed'] for t in later):,}",
                     f"{sum(t['computed'] for t in off[1:]):,}" if off else "-",
                     f"{min(ttft_on):.0f} / {statistics.median(ttft_on):.0f} / {max(ttft_on):.0f}",
                     f"{min(ttft_off):.0f} / {statistics.median(ttft_off):.0f} / {max(ttft_off):.0f}" if off else "-",
                     f"{ttft_on[-1] / ttft_on[0]:.2f}" if ttft_on else "-"])
        for ax, key, scale in ((axes[0], "computed", 1), (axes[1], "ttft_s", 1000)):
            line, = ax.plot([t["prompt"] for t in on], [t[key] * scale for t in on], marker="o", label=f"{name} on")
            if off:
                ax.plot([t["prompt"] for t in off], [t[key] * scale for t in off], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{name} off")
    for ax, label in ((axes[0], "prompt tokens computed"), (axes[1], "TTFT (ms)")):
        ax.set_xlabel("conversation length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    save_plot(fig, "agent_turns")
    per_turn = []
    for name, runs in models.items():
        for a, b in zip(runs["on"], runs.get("off", runs["on"])):
            per_turn.append([name, a["turn"], a["prompt"], a["new"], a["computed"], b["computed"],
                             f"{a['ttft_s'] * 1000:.0f}", f"{b['ttft_s'] * 1000:.0f}"])
    return ["## Agent turns: prefix caching on models with per-request state", "",
            f"Reproduce: `python benchmarks/agent_turns.py --out benchmarks/results/agent_turns.json` "
            f"({r['turns']} turns after a {r['system']}-token system prompt, 300-1,500 tokens of tool output and a "
            f"{r['reply']}-token reply per turn; tiny random-weight models, fp32, {r['machine']}). Caching on, a turn "
            "computes what is new since the last (the reply and the tool output) plus the tail of the last "
            "prompt's block; off, it recomputes the conversation. Qwen3.5 and DeepSeek-V4 resume from state "
            "checkpoints.", "", "![agent_turns](benchmarks/plots/agent_turns.png)", "",
            *table(["model", "worst computed / new (turns 2+)", "computed, on", "computed, off",
                    "TTFT on, ms (min / median / max)", "TTFT off, ms", "TTFT on, last / second turn"], rows), "",
            "<details><summary>Per turn</summary>", "",
            *table(["model", "turn", "prompt", "new", "computed on", "computed off", "TTFT on ms", "TTFT off ms"],
                   per_turn), "", "</details>", ""]
