"""The report section of benchmarks/tensor_parallel.py: TP N against TP 1 on this machine's CPUs."""
from __future__ import annotations

from typing import Any

from report_common import header, plt, save_plot, table


def tensor_parallel(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    lines = ["## 8. Tensor parallel on CPU (gloo)", "",
             f"{w['num_prompts']} requests, prompts uniform in {w['input_len']} tokens, outputs in {w['output_len']} "
             f"(greedy, ignore_eos; {w['prompt_tokens']:,} prompt and {w['output_tokens']:,} output tokens), all "
             "submitted at once; each size in a fresh process, timed around `generate`. Broadcast: what rank 0 "
             "spends per step pickling the step's payload once and writing it to each other rank's socket.", ""]
    lines += header(r, "tensor_parallel")
    rows = []
    for x in r["rows"]:
        bcast = (f"{x['broadcast_ms_per_step']:.3f} ms, {x['broadcast_bytes_per_step']:,.0f} B "
                 f"({100 * x['broadcast_share']:.2f}% of generate)") if "broadcast_ms_per_step" in x else "-"
        rows.append([x["tensor_parallel_size"], x["num_threads"], x["generate_s"], x["speed_vs_tp1"], x["steps"],
                     bcast, x["greedy_requests_identical_to_tp1"], x["startup_s"]])
    lines += table(["tensor_parallel_size", "threads per rank", "generate s", "speed vs TP 1", "steps",
                    "broadcast per step", "greedy requests identical to TP 1", "startup s"], rows) + [""]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar([str(x["tensor_parallel_size"]) for x in r["rows"]], [x["generate_s"] for x in r["rows"]],
           color="#1f77b4")
    ax.set_xlabel("tensor_parallel_size")
    ax.set_ylabel("generate seconds (lower is better)")
    ax.set_title(f"Same workload at each size, {r['machine']['cpus']} CPUs, gloo")
    save_plot(fig, "tensor_parallel")
    return lines
