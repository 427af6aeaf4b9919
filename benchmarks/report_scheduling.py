"""The report section of benchmarks/long_prompt_fairness.py: short requests beside long prefills."""
from __future__ import annotations

from typing import Any

from report_common import header, plt, save_plot, table


def fairness(r: dict[str, Any]) -> list[str]:
    rows = [[x["long_tokens"], x["variant"], x["settings"]["max_num_partial_prefills"], x["shorts"],
             _get(x, "short_ttft_ms", "p50"), _get(x, "short_ttft_ms", "p99"), _get(x, "short_e2e_ms", "p50"),
             x["long_s"], x["long_alone_s"], x["long_slowdown"]] for x in r["rows"]]
    lines = ["## 5. Long prompts do not block short ones", "",
             f"A long prompt prefills at max_num_batched_tokens {r['budget']} (the only settings given, with "
             f"max_model_len); {r['short_len']}-token requests ({r['short_out']} output tokens) arrive as a Poisson "
             f"stream of {r['rate']}/s over the long prompt's alone time. `after`: the derived partial-prefill "
             "settings; `before`: max_num_partial_prefills=1, one prefill at a time, as the scheduler ran before "
             "the caps. Times from the engine core's own loop (the server's engine process runs the same).", ""]
    lines += header(r, "long_prompt_fairness")
    lines += table(["long prompt tokens", "variant", "max_num_partial_prefills", "short requests",
                    "short TTFT p50 ms", "short TTFT p99 ms", "short E2E p50 ms", "long prompt s",
                    "long prompt alone s", "long / alone"], rows) + [""]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = [f"{x['long_tokens'] // 1000}K {x['variant']}" for x in r["rows"]]
    for k, (q, color) in enumerate((("p50", "#1f77b4"), ("p99", "#d62728"))):
        ax.bar([i + 0.4 * k for i in range(len(labels))], [_get(x, "short_ttft_ms", q) or 0 for x in r["rows"]],
               width=0.4, color=color, label=f"short TTFT {q}")
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend()
    ax.set_title("Short requests' time to first token while a long prompt prefills")
    save_plot(fig, "long_prompt_fairness")
    return lines


def _get(x: dict[str, Any], key: str, q: str) -> float | None:
    return None if x.get(key) is None else x[key][q]
