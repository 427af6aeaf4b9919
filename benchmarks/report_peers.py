"""The report sections of benchmarks/vllm_side_by_side.py and vllm_serve_side_by_side.py: ladle beside vLLM's CPU
build, offline and serving."""
from __future__ import annotations

import statistics
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


def vllm_serve_peer(r: dict[str, Any]) -> list[str]:
    """Both servers, both clients, every rate: TTFT and ITL p50 / p99 side by side, and their ratios."""
    name = r.get("out", "vllm_serve_side_by_side")  # one section (and plot) per run: one per model
    lines = [f"## 7b. Serving beside vLLM (CPU build), {r['model']}", "",
             f"`ladle serve` and `vllm serve` (vLLM {r.get('vllm_version', '')}) on `{r['model']}`, {r['dtype']}, "
             f"max_model_len {r['max_model_len']}, each with its defaults otherwise, both up and taking turns (one loaded at a time, "
             f"the order flipping from cell to cell so drift falls on both). At each Poisson rate (about {r['seconds']:.0f} s of arrivals) two clients take turns: vLLM's own "
             f"`vllm bench serve` (random dataset) and `ladle bench serve`'s client (random token ids); prompts "
             f"{r['input_len']} tokens, outputs {r['output_len']} (greedy, ignore_eos, streaming). Startup is "
             "launch to a healthy /health.", ""]
    lines += header(r, name)
    servers = {s["engine"]: s for s in r["servers"]}
    lines += [f"Startup: ladle {servers['ladle']['startup_s']:.1f} s, vLLM {servers['vllm']['startup_s']:.1f} s. "
              "Threads: " + "; ".join(f"{e}: " + " / ".join(list(dict.fromkeys(" ".join(x.split()) for x in s["thread_settings"]))[:3])
                                         for e, s in servers.items()),
              ""]
    pts = median_cells(r["points"])
    repeats = r.get("repeats", 1)
    if repeats > 1:
        lines += [f"Each cell is the median over {repeats} repeats of the whole set (each with prompts of its own), "
                  f"with a {r['settle_s']:.0f} s pause before each cell.", ""]
    rows = []
    for client in ("vllm", "ladle"):
        for rate in sorted({k[2] for k in pts}):
            a, b = pts[("ladle", client, rate)], pts[("vllm", client, rate)]
            row = [f"`{client} bench serve`", rate, f"{a['completed']} / {b['completed']}"]
            for key in ("ttft_ms", "itl_ms", "tpot_ms"):
                for q in ("median", "p99"):
                    row.append(f"{a[key][q]:.1f} / {b[key][q]:.1f} ({a[key][q] / b[key][q]:.2f})")
            rows.append(row)
    lines += ["Each cell: ladle / vLLM (ratio; below 1 is ladle faster).", ""]
    lines += table(["client", "rate req/s", "completed"] + [f"{m} {q} ms" for m in ("TTFT", "ITL", "TPOT")
                                                               for q in ("p50", "p99")], rows) + [""]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    rates = sorted({k[2] for k in pts})
    for ax, key in zip(axes, ("ttft_ms", "itl_ms")):
        for engine, color in (("ladle", "#1f77b4"), ("vllm", "#ff7f0e")):
            for q, style in (("median", "o-"), ("p99", "s--")):
                ax.plot(rates, [pts[(engine, "vllm", x)][key][q] for x in rates], style, color=color,
                        label=f"{engine} {'p50' if q == 'median' else q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{key[:-3].upper()} ms (vllm bench serve)")
        ax.legend(fontsize=7)
    fig.suptitle("Serving latency at equal Poisson rates: ladle serve vs vllm serve")
    save_plot(fig, name)
    return lines


def median_cells(points: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(server, client, rate) -> that cell's completed count (the least) and each latency quantile's median
    over the repeats."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["server"], p["client"], p["rate"]), []).append(p)
    return {key: {"completed": min(p["completed"] for p in ps),
                  **{m: {q: statistics.median(p[m][q] for p in ps) for q in ("median", "p99")}
                     for m in ("ttft_ms", "itl_ms", "tpot_ms")}}
            for key, ps in groups.items()}


def bf16_agreement(r: dict[str, Any]) -> list[str]:
    """ladle bf16 against HF bf16: identical requests, and each first divergence with its float32 margin."""
    s, chunking = r["summary"], r.get("ladle_settings") or {}
    title = "chunked prefill (" + ", ".join(f"{k} {v}" for k, v in chunking.items()) + ")" if chunking else \
        "default settings"
    lines = [f"### bf16 greedy tokens against HF bf16, {title}", "", f"Reproduce: `{r['command']}`", "",
             f"`{r['model']}`, {len(r['rows'])} requests (prompts {r['input_len']}, outputs {r['output_len']}): "
             f"**{s['identical']} identical** to HF's bf16 greedy tokens, {s['diverged']} part from them, "
             f"{s['diverged_by_rounding']} of those at a rounding tie; at the parting token float32 prefers "
             f"ladle's pick in {s['ladle_agrees_with_float32_at_divergence']} of {s['diverged']}.", "",
             "| request | prompt | parts at token | float32 margin (ladle - HF pick) | HF bf16 logit error there | "
             "ladle bf16 margin | rounding tie |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        if x["first_divergence"] is not None:
            ladle = "n/a" if x["ladle_bf16_margin"] is None else f"{x['ladle_bf16_margin']:.4f}"
            lines.append(f"| {x['request']} | {x['prompt_len']} | {x['first_divergence']} | "
                         f"{x['reference_margin']:+.4f} | {x['low_precision_logit_error']:.4f} | {ladle} | "
                         f"{'yes' if x['rounding'] else 'no'} |")
    return lines + [""]
