"""The report section of benchmarks/quantized.py: weight bytes, batch-1 decode and a 1K prefill per format."""
from __future__ import annotations

from typing import Any

from report_common import header, plt, save_plot, table


def quantized(r: dict[str, Any]) -> list[str]:
    rows, names = r["rows"], [x["variant"] for x in r["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, label, scale in ((axes[0], "weight_bytes", "resident weights (MiB)", 2**-20),
                                  (axes[1], "decode_tok_s", "batch-1 decode (tok/s)", 1),
                                  (axes[2], "prefill_s", f"{r['prefill_tokens']}-token prefill (s)", 1)):
        ax.bar(names, [x[key] * scale for x in rows], color=["#888", "#4a7", "#c63", "#e96", "#666", "#396", "#c63", "#75c"][: len(rows)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=15)
        ax.grid(axis="y", alpha=0.3)
    save_plot(fig, "quantized")
    ratio = r["ratios"]
    return ["## Release weight formats: FP8 and MXFP4 kept quantized", "", *header(r, "quantized"),
            *table(["variant", "weights", "resident weights MiB", "batch-1 decode tok/s", "prefill s"],
                   [[x["variant"], x["weights"], f"{x['weight_bytes'] / 2**20:.0f}", f"{x['decode_tok_s']:.1f}",
                     f"{x['prefill_s']:.2f}"] for x in rows]), "",
            f"FP8 decode {ratio['fp8_decode_over_bf16']:.2f}x bf16's and {ratio['fp8_decode_over_fp32']:.2f}x "
            f"fp32's (goals 1.5x and 2.5x); FP8 prefill {ratio['fp8_prefill_over_bf16']:.2f}x bf16's time (goal "
            f"within 1.2x). Medians of {r['repeats']} interleaved turns.", ""] + ([
                f"On {r['moe_model']}: FP8 decode {ratio['moe_fp8_decode_over_bf16']:.2f}x bf16's; FP8 with MXFP4 "
                f"experts {ratio['moe_mxfp4_decode_over_bf16']:.2f}x bf16's and "
                f"{ratio['moe_mxfp4_decode_over_fp32']:.2f}x fp32's, its prefill "
                f"{ratio['moe_mxfp4_prefill_over_bf16']:.2f}x bf16's time.", ""] if "moe_model" in r else [])
