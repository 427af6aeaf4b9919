"""The report section of benchmarks/cpu_isa.py: ladle's CPU paths at each instruction-set level of one CPU."""
from __future__ import annotations

from typing import Any

from report_common import plt, save_plot, table


def cpu_isa(r: dict[str, Any]) -> list[str]:
    lines = ["## One CPU, every instruction-set level (issue 58)", "",
             f"Reproduce: `{r['command']}` (each engine row in its own process with `LADLE_CPU_ISA` set; oneDNN "
             "capped with it). CPU: " + r["cpu"] + f"; model `{r['model']}` (~100M parameters, random weights).", ""]
    if "kernels" in r:
        paths = [k for k in r["kernels"][0] if k not in ("dtype", "rows")]
        lines += [f"Every linear of the model once per step (weights streamed from memory, as decode reads them), "
                  f"{r['kernel_threads']} thread, ms per step, median of interleaved repeats; `skinny <level>` is "
                  "ladle's decode kernel as built for that level:", ""]
        lines += table(["dtype", "rows", *paths],
                       [[k["dtype"], k["rows"], *(float(k[p]) for p in paths)] for k in r["kernels"]])
        lines.append("")
    engine = r["engine"]
    lines += ["The engine at each level (2 threads): TTFT of one 512-token prompt, batch-1 decode (ITL p50 over 128 "
              "tokens), 16 requests x 128 tokens (output tok/s), medians of 3 repeats with new prompts each; greedy "
              "tokens of 4 requests x 32 against the CPU's own level:", ""]
    lines += table(["dtype", "level", "TTFT 512 ms", "decode ITL ms", "decode tok/s", "16 x 128 out tok/s",
                    "tokens = native"],
                   [[e["dtype"], e["level"], float(e["ttft_512_ms"]), float(e["decode_itl_ms"]),
                     1000 / e["decode_itl_ms"], float(e["batch16_output_tok_s"]),
                     "yes" if e["tokens_equal_native"] else "no"] for e in engine])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for dtype, shift in (("float32", -0.2), ("bfloat16", 0.2)):
        rows = [e for e in engine if e["dtype"] == dtype]
        xs = [i + shift for i in range(len(rows))]
        for ax, key, scale in ((axes[0], "ttft_512_ms", 1.0), (axes[1], "decode_itl_ms", -1.0),
                               (axes[2], "batch16_output_tok_s", 1.0)):
            vals = [1000 / e[key] if scale < 0 else e[key] for e in rows]
            ax.bar(xs, vals, width=0.4, label=dtype)
            ax.set_xticks(range(len(rows)), [e["level"] for e in rows])
    axes[0].set_title("TTFT, 512-token prompt (ms, lower is better)")
    axes[1].set_title("batch-1 decode (tok/s)")
    axes[2].set_title("16 requests x 128 tokens (output tok/s)")
    for ax in axes:
        ax.legend()
        ax.set_yscale("log")
    fig.suptitle(r["cpu"], fontsize=8)
    save_plot(fig, "cpu_isa")
    lines += ["", "![cpu_isa](benchmarks/plots/cpu_isa.png)", ""]
    return lines
