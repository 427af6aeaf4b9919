"""The report section of benchmarks/agent_turns.py: tokens computed and TTFT per turn, prefix caching on vs off,
ladle and (on Qwen3) vLLM's CPU build in the same run."""
from __future__ import annotations

import statistics
from typing import Any

from report_common import plt, save_plot, table


def _runs(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"ladle {name}", runs) for name, runs in r["models"].items()] + [
        (f"vLLM {name}", runs) for name, runs in r.get("vllm", {}).items()]


def _ms(turns: list[dict[str, Any]]) -> str:
    ms = [t["ttft_s"] * 1000 for t in turns]
    return f"{min(ms):.0f} / {statistics.median(ms):.0f} / {max(ms):.0f}" if ms else "-"


def _per_1k(t: dict[str, Any]) -> float:
    """TTFT per 1,000 prompt tokens computed: flat when a turn costs only what it computes."""
    return t["ttft_s"] * 1e6 / max(t["computed"], 1)


def agent_turns(r: dict[str, Any]) -> list[str]:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    rows = []
    for label, runs in _runs(r):
        on, off = runs["on"], runs.get("off", [])
        later = on[1:]
        worst = max(t["computed"] / t["new"] for t in later) if later else float("nan")
        rows.append([label, f"{worst:.2f}", f"{sum(t['computed'] for t in later):,}",
                     f"{sum(t['computed'] for t in off[1:]):,}" if off else "-", _ms(later), _ms(off[1:]),
                     f"{_per_1k(later[0]):.0f} / {_per_1k(later[-1]):.0f}" if later else "-",
                     runs.get("replies_identical_on", "-")])
        style = dict(linestyle=":" if label.startswith("vLLM") else "-")
        line, = axes[0].plot([t["prompt"] for t in on], [t["computed"] for t in on], marker="o", label=f"{label} on",
                             **style)
        axes[1].plot([t["prompt"] for t in on], [t["ttft_s"] * 1000 for t in on], marker="o", color=line.get_color(),
                     label=f"{label} on", **style)
        axes[2].plot([t["prompt"] for t in later], [_per_1k(t) for t in later], marker="o", color=line.get_color(),
                     label=f"{label} on", **style)
        if off:
            for ax, key, scale in ((axes[0], "computed", 1), (axes[1], "ttft_s", 1000)):
                ax.plot([t["prompt"] for t in off], [t[key] * scale for t in off], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{label} off")
    for ax, title in ((axes[0], "prompt tokens computed"), (axes[1], "TTFT (ms)"),
                      (axes[2], "TTFT per 1K tokens computed, caching on (ms)")):
        ax.set_xlabel("conversation length (tokens)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=6)
    save_plot(fig, "agent_turns")
    per_turn = []
    for label, runs in _runs(r):
        for a, b in zip(runs["on"], runs.get("off", runs["on"])):
            per_turn.append([label, a["turn"], a["prompt"], a["new"], a["computed"], b["computed"],
                             f"{a['ttft_s'] * 1000:.0f}", f"{b['ttft_s'] * 1000:.0f}"])
    return ["## Agent turns: prefix caching on models with per-request state", "",
            f"Reproduce: `python benchmarks/agent_turns.py --out benchmarks/results/agent_turns.json` "
            f"({r['turns']} turns after a {r['system']}-token system prompt, 300-1,500 tokens of tool output and a "
            f"{r['reply']}-token reply per turn; tiny random-weight models, fp32, {r['machine']}; each engine, "
            "model and setting in a fresh process, ladle and vLLM interleaved). Caching on, a turn computes what "
            "is new since the last (the reply and the tool output) plus the tail of the last prompt's block; off, "
            "it recomputes the conversation. Qwen3.5 and DeepSeek-V4 resume from state checkpoints. vLLM's CPU "
            "build serves only Qwen3 of the three.", "", "![agent_turns](benchmarks/plots/agent_turns.png)", "",
            *table(["engine, model", "worst computed / new (turns 2+)", "computed, on", "computed, off",
                    "TTFT on, ms (min / median / max)", "TTFT off, ms", "TTFT on per 1K computed, second / last turn",
                    "replies equal to ladle's"], rows), "",
            "<details><summary>Per turn</summary>", "",
            *table(["engine, model", "turn", "prompt", "new", "computed on", "computed off", "TTFT on ms",
                    "TTFT off ms"], per_turn), "", "</details>", ""]
