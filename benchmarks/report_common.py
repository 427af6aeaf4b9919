"""What the report's sections share: where results and plots live, tables, headers, notes, plots."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
# The environment overrides are for trying the scripts without touching the committed results.
RESULTS = Path(os.environ.get("LADLE_BENCH_RESULTS") or HERE / "results")
PLOTS = Path(os.environ.get("LADLE_BENCH_PLOTS") or HERE / "plots")
OUT = Path(os.environ.get("LADLE_BENCH_REPORT") or HERE.parent / "BENCHMARKS.md")
LAT = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def cell(v: Any) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:,.0f}"


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    fmt = [cell(v) for r in rows for v in r]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for i in range(len(rows)):
        out.append("| " + " | ".join(fmt[i * len(head):(i + 1) * len(head)]) + " |")
    return out


def header(r: dict[str, Any], plot: str) -> list[str]:
    m, cfg = r["machine"], r.get("model_config", {})
    omp = f"OMP_NUM_THREADS={m['OMP_NUM_THREADS']} " if m.get("OMP_NUM_THREADS") else ""
    return [f"Reproduce: `{omp}{r['command']}`", "",
            f"Model `{r.get('model')}`: Qwen3, hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} "
            f"layers, {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} heads x "
            f"{cfg.get('head_dim')}, MLP {cfg.get('intermediate_size')}, vocab {cfg.get('vocab_size')}, random "
            f"weights, fp32. Machine: {m['cpus']} CPUs ({m['cpu']}), torch {m['torch']} with {m['threads']} "
            f"thread(s), transformers {m['transformers']}; load average at the end "
            f"{', '.join(f'{x:.1f}' for x in m.get('load_average_1_5_15', []))} (a shared machine).", "",
            f"![{plot}](benchmarks/plots/{plot}.png)", ""]


def notes(name: str) -> list[str]:
    path = RESULTS / f"notes_{name}.md"
    return [path.read_text().rstrip(), ""] if path.exists() else []


def save_plot(fig: Any, name: str) -> None:
    PLOTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOTS / f"{name}.png", dpi=110)
    plt.close(fig)
