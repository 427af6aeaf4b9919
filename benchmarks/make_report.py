"""Turn benchmarks/results/*.json into BENCHMARKS.md (tables) and benchmarks/plots/*.png (matplotlib).

Each section shows the command that produced its JSON. Hand-written analysis (profiles, where a goal is
missed) lives in benchmarks/results/notes_<benchmark>.md and is placed under its section; planner.md and
prefix_cache.md, written by their own scripts, are included as they are.

    python benchmarks/make_report.py
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_common import LAT, OUT, RESULTS, header, load, notes, plt, save_plot, table  # noqa: E402
from report_agent import agent_turns  # noqa: E402
from report_cpu_isa import cpu_isa  # noqa: E402
from report_parallel import tensor_parallel  # noqa: E402
from report_quantized import quantized  # noqa: E402
from report_llamacpp import llamacpp_gguf  # noqa: E402
from report_peers import bf16_agreement, vllm_peer, vllm_serve_peer  # noqa: E402
from report_scheduling import fairness  # noqa: E402
from report_structured import structured  # noqa: E402
from report_long_context import long_context  # noqa: E402
from report_spec_decode import spec_decode  # noqa: E402
from report_spec_decode_mtp import spec_decode_mtp  # noqa: E402
from report_expert_tiering import expert_tiering  # noqa: E402
from report_gpu import gpu_section  # noqa: E402
from report_perplexity import perplexity_lines  # noqa: E402
from report_spec_decode_smollm2 import spec_decode_smollm2  # noqa: E402


def offline(r: dict[str, Any]) -> list[str]:
    w, s = r["workload"], r["settings"]
    names = list(r["runs"])
    med = {n: sorted(x["total_tok_per_s"] for x in r["runs"][n])[len(r["runs"][n]) // 2] for n in names}
    rows = []
    for n in names:
        m = r["median_run"][n]
        rows.append([n, m["requests_per_s"], m["output_tok_per_s"], m["total_tok_per_s"]]
                    + [f"{m[k]['mean']:.0f} / {m[k]['median']:.0f} / {m[k]['p99']:.0f}" for k in LAT])
    ratio = r["ratios"].get("ladle/best_hf", {})
    lines = ["## 1. Offline throughput, mixed lengths", "",
             f"{w['num_prompts']} requests per repeat, prompts uniform in {w['input_len']} tokens, outputs uniform "
             f"in {w['output_len']} (greedy, EOS ignored), a fresh random workload per repeat shared by every "
             f"engine; {s['repeats']} repeats, engines in rotating order. ladle: max_num_batched_tokens "
             f"{s['max_num_batched_tokens']}, max_model_len {s['ladle_max_model_len']}, other settings derived. "
             f"HF generate: static batches of {s['hf_batch_size']}, left-padded, each run to its longest output. "
             f"HF generate_batch: max_batch_tokens {s['max_num_batched_tokens']}, page_size {s['page_size']}, "
             "num_blocks for the whole workload.", ""] + header(r, "offline_throughput")
    lines += table(["engine", "req/s", "output tok/s", "total tok/s"] +
                   [f"{k[:-3].upper()} ms mean / median / p99" for k in LAT], rows)
    lines.append("")
    for k, v in r["ratios"].items():
        lines.append(f"- {k}: median {v['median']:.2f}x (per repeat {', '.join(f'{x:.2f}' for x in v['per_repeat'])})")
    if ratio:
        met = "met" if ratio["median"] >= 2 else f"missed by {2 - ratio['median']:.2f}x"
        lines.append(f"- **Goal ladle >= 2x the best HF path (total tok/s): {ratio['median']:.2f}x, {met}.**")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, n in enumerate(names):
        vals = [x["total_tok_per_s"] for x in r["runs"][n]]
        ax.bar(i, med[n], color=["#d62728", "#1f77b4", "#2ca02c"][i % 3])
        ax.plot([i] * len(vals), vals, "k.", ms=5)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("total tokens/s (bar: median; dots: repeats)")
    ax.set_title("Offline throughput, same workload")
    save_plot(fig, "offline_throughput")
    return lines + [""]


def _model_line(r: dict[str, Any]) -> tuple[str, str]:
    """(section title, the model's description) for the offline rows beside section 1."""
    cfg = r["model_config"]
    size = f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers"
    if cfg.get("num_local_experts"):
        return "Qwen3-MoE", (f"Qwen3-MoE, {size}, {cfg['num_local_experts']} experts of "
                             f"{cfg['moe_intermediate_size']}, top {cfg['num_experts_per_tok']} per token")
    kinds = cfg.get("layer_types") or []
    if cfg.get("compress_rates"):
        rates = cfg["compress_rates"]
        return "DeepSeek-V4", (
            f"DeepSeek-V4, {size} ({kinds.count('compressed_sparse_attention')} CSA at rate "
            f"{rates['compressed_sparse_attention']} with top-{cfg['index_topk']}, "
            f"{kinds.count('heavily_compressed_attention')} HCA at rate {rates['heavily_compressed_attention']}, "
            f"{kinds.count('sliding_attention')} sliding-window only; window {cfg['sliding_window']}), "
            f"{cfg['num_attention_heads']} heads x {cfg['head_dim']} over one shared K=V head, "
            f"{cfg['n_routed_experts']} experts of {cfg['moe_intermediate_size']}, top {cfg['num_experts_per_tok']}, "
            f"{cfg['hc_mult']} hyper-connection streams")
    return "Qwen3.5 (Gated DeltaNet hybrid)", (
        f"Qwen3.5, {size} ({kinds.count('linear_attention')} Gated DeltaNet, {kinds.count('full_attention')} "
        f"gated full attention), {cfg['linear_num_value_heads']} value heads x {cfg['linear_value_head_dim']} "
        f"over {cfg['linear_num_key_heads']} key heads x {cfg['linear_key_head_dim']}")


def offline_variant(r: dict[str, Any]) -> list[str]:
    """A row beside section 1: the same workload shape and engines on another architecture."""
    w, m = r["workload"], r["machine"]
    title, model = _model_line(r)
    lines = [f"### {title}", "",
             f"Reproduce: `OMP_NUM_THREADS={m.get('OMP_NUM_THREADS') or ''} {r['command']}`", "",
             f"Model `{r['model']}`: {model}, random weights, fp32; {w['num_prompts']} requests per repeat, prompts "
             f"in {w['input_len']}, outputs in {w['output_len']}.", ""]
    rows = [[n, x["requests_per_s"], x["output_tok_per_s"], x["total_tok_per_s"]]
            for n, x in r["median_run"].items()]
    lines += table(["engine", "req/s", "output tok/s", "total tok/s"], rows) + [""]
    for k, v in r["ratios"].items():
        lines.append(f"- {k}: median {v['median']:.2f}x (per repeat {', '.join(f'{x:.2f}' for x in v['per_repeat'])})")
    return lines + [""]


def memory(r: dict[str, Any]) -> list[str]:
    rows = [[x["prompt_tokens"], x.get("ladle_peak_mib", float("nan")), x.get("ladle_predicted_mib", float("nan")),
             x.get("hf_peak_mib", float("nan")), x["hf_kv_cache_mib"]] for x in r["rows"]]
    lines = ["## 2. Peak activation memory vs prompt length", "",
             f"ladle at max_num_batched_tokens {r['chunk']} vs one HF forward of the whole prompt; peaks from "
             "`ladle.startup.memory.measure_peak` (torch.profiler allocation events). ladle's KV pool exists before "
             "the call and is not counted; HF allocates its KV cache inside the call, so it is counted (its size is "
             "in the last column).", ""]
    lines += header(r, "memory_vs_prompt")
    lines += table(["prompt tokens", "ladle peak MiB", "ladle planner prediction MiB", "HF peak MiB",
                    "of which HF KV cache MiB"], rows)
    top = max(x["prompt_tokens"] for x in r["rows"])
    if r.get("ladle_top_over_2k") is not None:
        v = r["ladle_top_over_2k"]
        met = "met" if v <= r["goal_ladle_top_over_2k"] else "missed"
        lines += ["", f"- **ladle peak at {top:,} / at 2,048 tokens: {v:.3f} (goal <= 1.15, {met}).** "
                  f"HF: {r.get('hf_top_over_2k') or float('nan'):.1f}x."]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    xs = [x["prompt_tokens"] for x in r["rows"]]
    for key, label in (("ladle_peak_mib", f"ladle, chunk {r['chunk']}"), ("hf_peak_mib", "HF single forward")):
        if key in r["rows"][0]:
            ax.plot(xs, [x[key] for x in r["rows"]], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak activation MiB")
    ax.legend()
    ax.set_title("Activation peak vs prompt length")
    save_plot(fig, "memory_vs_prompt")
    return lines + [""]


def chunk(r: dict[str, Any]) -> list[str]:
    rows = [[x["budget"], x["chunks"], x["wall_s_median"], x["cpu_s_median"], x["vs_single_median"]] for x in r["rows"]]
    lines = ["## 3. Chunking overhead", "",
             f"Prefill of one {r['prompt_len']:,}-token prompt (one output token) at each step budget vs the single "
             f"pass (budget {r['single_pass_budget']}); {r['repeats']} repeats, budgets in rotating order, the "
             "ratio taken within each repeat.", ""] + header(r, "chunk_overhead")
    lines += table(["budget", "chunks", "wall s (median)", "CPU s (median)", "time / single pass"], rows)
    by = {x["budget"]: x["vs_single_median"] for x in r["rows"]}
    if 512 in by:
        met = "met" if by[512] <= 1.10 else f"missed by {(by[512] - 1.10) * 100:.0f} points"
        lines += ["", f"- **Budget 512 costs {(by[512] - 1) * 100:+.1f}% (goal <= +10%, {met}).**"]
    if r.get("hf_forward_s_median"):
        lines.append(f"- HF single forward of the same prompt: {r['hf_forward_s_median']:.2f} s median, "
                     f"{r['hf_over_ladle_single_median']:.2f}x ladle's single pass.")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.bar([str(x["budget"]) for x in r["rows"]], [x["vs_single_median"] for x in r["rows"]], color="#1f77b4")
    ax.axhline(1.10, color="r", ls="--", label="goal for 512: 1.10")
    ax.set_xlabel("step budget (tokens)")
    ax.set_ylabel("prefill time / single pass")
    ax.legend()
    ax.set_title(f"Chunking overhead, {r['prompt_len']}-token prompt")
    save_plot(fig, "chunk_overhead")
    return lines + [""]


def stall(r: dict[str, Any]) -> list[str]:
    rows = [["yes" if x["chunking"] else "no", x["budget"], x["long_chunks"], x["ttft_long_s"], x["median_step_ms"],
             x["median_itl_ms"], x["max_itl_ms"], x["max_over_median_step"]] for x in r["rows"]]
    lines = ["## 4. Stall-free decoding", "",
             f"{r['decodes']} requests decoding ({r['decode_prompt']}-token prompts) when a {r['long_prompt']:,}-"
             "token prompt arrives; the engine is stepped as LLM.generate steps it and each decode token is "
             "timestamped. Window: from the arrival to a few steps after the long prompt's first token.", ""]
    lines += header(r, "stall_free")
    lines += table(["chunking", "budget", "long-prompt chunks", "long TTFT s", "median step ms", "median ITL ms",
                    "max ITL ms", "max ITL / median step"], rows)
    lines.append("")
    for x in r["rows"]:
        if x["chunking"]:
            met = "met" if x["max_over_median_step"] <= 2 else "missed"
            lines.append(f"- budget {x['budget']}: max ITL = {x['max_over_median_step']:.2f} x the median step "
                         f"(goal <= 2, {met})")
        else:
            lines.append(f"- no chunking: max ITL = {x['max_over_median_step']:.1f} x the median step "
                         f"({x['max_itl_ms'] / 1000:.1f} s stall)")
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for x in r["rows"]:
        line, = ax.plot(x["step_ms_series"], ".-",
                        label=f"budget {x['budget']}" + ("" if x["chunking"] else " (no chunking)"))
        if x["chunking"]:
            ax.axhline(2 * x["median_step_ms"], color=line.get_color(), ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step since the long prompt arrived")
    ax.set_ylabel("step time ms (= ITL of every decode)")
    ax.legend()
    ax.set_title("Decode stalls while a long prompt prefills (dotted: 2 x median step)")
    save_plot(fig, "stall_free")
    return lines + [""]


def serve(r: dict[str, Any]) -> list[str]:
    pts = r["points"]
    rows = [[p["request_rate"], p["num_prompts"], p["requests_per_s"], p["output_tok_per_s"]]
            + [f"{p[k]['median']:.0f} / {p[k]['p99']:.0f}" for k in LAT] for p in pts]
    lines = ["## 6. Serving: latency vs request rate", "",
             f"`ladle serve {r['server_flags']}` (OMP_NUM_THREADS={r['server_threads']}) on 127.0.0.1, started "
             f"as a subprocess (healthy after {r['server_startup_s']:.0f} s). Per rate: Poisson arrivals for about "
             f"{r['seconds']:.0f} s, prompts uniform in {r['input_len']}, outputs in {r['output_len']} tokens "
             "(greedy, ignore_eos), streaming /v1/completions; ITL is between streamed chunks, as vLLM's client "
             "counts it.", ""] + header(r, "serve_sweep")
    lines += table(["rate req/s", "requests", "achieved req/s", "output tok/s"] +
                   [f"{k[:-3].upper()} ms p50 / p99" for k in LAT], rows)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    rates = [p["request_rate"] for p in pts]
    for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms")):
        ax.plot(rates, [p[key]["median"] for p in pts], "o-", label="p50")
        ax.plot(rates, [p[key]["p99"] for p in pts], "s--", label="p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{key[:-3].upper()} ms")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("ladle serve: latency vs Poisson request rate")
    save_plot(fig, "serve_sweep")
    return lines + [""]


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("offline_throughput", offline), ("offline_throughput_moe", offline_variant),
    ("offline_throughput_qwen3_5", offline_variant), ("offline_throughput_dsv4", offline_variant),
    ("memory_vs_prompt", memory), ("chunk_overhead", chunk),
    ("stall_free", stall), ("long_prompt_fairness", fairness), ("serve_sweep", serve),
    ("vllm_side_by_side", vllm_peer), ("bf16_agreement", bf16_agreement), ("bf16_agreement_chunked", bf16_agreement),
    ("vllm_serve_side_by_side", vllm_serve_peer), ("vllm_serve_side_by_side_768", vllm_serve_peer),
    ("tensor_parallel", tensor_parallel), ("agent_turns", agent_turns), ("quantized", quantized),
    ("llamacpp_gguf", llamacpp_gguf),
    ("structured", structured), ("long_context", long_context), ("spec_decode", spec_decode),
    ("spec_decode_mtp", spec_decode_mtp), ("expert_tiering", expert_tiering), ("perplexity", perplexity_lines),
    ("spec_decode_smollm2", spec_decode_smollm2), ("cpu_isa", cpu_isa)]


def main() -> None:
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/make_report.py` from `benchmarks/results/*.json`; every section "
             "names the command that produced it. All numbers are from a 2-core CPU machine shared with other "
             "jobs, so absolute times are noisy: compare the ratios, which come from side-by-side runs in one "
             "process (medians of repeats). llama.cpp is measured in one section, \"SmolLM2 GGUF beside llama.cpp\" "
             "(its script builds llama.cpp from source, about 10 minutes on 2 cores, once).", ""]
    lines += notes("summary")
    for name, section in SECTIONS:
        r = load(name)
        if r is not None:
            lines += section(r) + notes(name)
    for name, title in (("planner", "## Memory planner accuracy"), ("prefix_cache", None), ("agent_sessions", None), ("replica_routing", None),
                        ("host_overhead", None),
                        ("server_abuse", None), ("hostile_corpus", None), ("startup", None), ("threads", None), ("dsv4_flash_plan", None),
                        ("qwen4_flash_next_plan", None),
                        ("cpu_linear", None), ("cpu_decode_attention", None)):
        path = RESULTS / f"{name}.md"
        if path.exists():
            body = path.read_text().rstrip()
            lines += ([title, "", "From `python benchmarks/planner_accuracy.py --out benchmarks/results/planner.md`.",
                       ""] if title else []) + [body, ""] + notes(name)
    lines += gpu_section()
    OUT.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
