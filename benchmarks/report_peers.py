"""The report section of benchmarks/vllm_side_by_side.py: ladle beside vLLM's CPU build."""
from __future__ import annotations

from typing import Any

from report_common import header, plt, save_plot, table


def vllm_peer(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    rows = [[x["dtype"], x["ladle_generate_s"], x["vllm_generate_s"], x["ladle_over_vllm_speed"],
             x["ladle_startup_s"], x["vllm_startup_s"], x["greedy_requests_identical"]] for x in r["rows"]]
    lines = ["## 7. Beside vLLM (CPU build)", "",
             f"vLLM {r.get('vllm_version', '')} from `benchmarks/setup_vllm.sh` (its own venv). {w['num_prompts']} "
             f"requests, prompts uniform in {w['input_len']} tokens, outputs in {w['output_len']} (greedy, "
             f"ignore_eos; {w['prompt_tokens']:,} prompt and {w['output_tokens']:,} output tokens), all submitted "
             "at once; each engine in a fresh process with its default settings, timed around `generate` alone; "
             "startup is the engine's constructor.", ""]
    lines += header(r, "vllm_side_by_side")
    lines += table(["dtype", "ladle generate s", "vLLM generate s", "ladle speed / vLLM", "ladle startup s",
                    "vLLM startup s", "greedy requests identical"], rows) + [""]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for k, (engine, color) in enumerate((("ladle", "#1f77b4"), ("vllm", "#ff7f0e"))):
        ax.bar([i + 0.4 * k for i in range(len(r["rows"]))], [x[f"{engine}_generate_s"] for x in r["rows"]],
               width=0.4, color=color, label=engine)
    ax.set_xticks([i + 0.2 for i in range(len(r["rows"]))], [x["dtype"] for x in r["rows"]])
    ax.set_ylabel("generate seconds (lower is better)")
    ax.legend()
    ax.set_title("Same workload, same checkpoint: ladle vs vLLM on CPU")
    save_plot(fig, "vllm_side_by_side")
    return lines
