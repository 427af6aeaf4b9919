"""CPU linear layers by row count: torch's F.linear (row-major weight), the same weight read column-major, and
oneDNN's pre-packed weight (ladle.models.cpu_linear, as vLLM's CPU backend runs its linears), one thread, on
the shapes of a model's layers and head. Each cell is the median of interleaved repeats. The first table calls
one weight again and again (hot in cache: per-call costs); the second runs every linear of the model once per
step, as a decode step does, so the weights stream from memory.

    python benchmarks/cpu_linear.py --model-name qwen3-512 --out benchmarks/results/cpu_linear.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, command, machine  # noqa: E402

from ladle.models.cpu_linear import pack, packed_linear  # noqa: E402


def per_call_ms(fn: Callable[[], object], seconds: float = 0.03) -> float:
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = MODELS[args.model_name]
    h, inter, heads, kv, hd = (m["hidden_size"], m["intermediate_size"], m["num_attention_heads"],
                               m["num_key_value_heads"], m["head_dim"])
    shapes = {"qkv": (h, (heads + 2 * kv) * hd), "o": (heads * hd, h), "gate_up": (h, 2 * inter),
              "down": (inter, h), "head": (h, m["vocab_size"])}
    lines = ["## CPU linear layers: row-major, column-major, oneDNN-packed", "", f"Reproduce: `{command()}`", "",
             f"`{args.model_name}` shapes, fp32, 1 thread, ms per call (median of {args.repeats} interleaved "
             f"repeats); machine: {machine()['cpus']} CPUs, torch {machine()['torch']}. Packed / row-major below "
             "1 is oneDNN faster.", "",
             "| layer | in x out | rows | F.linear | column-major | packed | packed / F.linear |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, (k, n) in shapes.items():
        weight = torch.randn(n, k)
        column_major, packed = weight.t().contiguous().t(), pack(weight)
        for rows in args.rows:
            x = torch.randn(rows, k)
            fns = [lambda: F.linear(x, weight), lambda: F.linear(x, column_major),
                   lambda: packed_linear(x, packed, None)]
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(args.repeats):
                for t, fn in zip(times, fns):
                    t.append(per_call_ms(fn))
            med = [statistics.median(t) for t in times]
            lines.append(f"| {name} | {k} x {n} | {rows} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | "
                         f"{med[2] / med[0]:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Every linear of `{args.model_name}` once per step ({m['num_hidden_layers']} layers and the "
              "head, weights streamed from memory), ms per step:", "",
              "| rows | F.linear | column-major | packed | packed / F.linear |", "|---:|---:|---:|---:|---:|"]
    layers = [shapes[k] for k in ("qkv", "o", "gate_up", "down")] * m["num_hidden_layers"] + [shapes["head"]]
    weights = [torch.randn(n, k) for k, n in layers]
    variants = [[(w, F.linear) for w in weights], [(w.t().contiguous().t(), F.linear) for w in weights],
                [(pack(w), lambda x, p: packed_linear(x, p, None)) for w in weights]]
    for rows in args.rows[:-1]:
        inputs = {k: torch.randn(rows, k) for k, _ in layers}

        def step(variant: list, rows: int = rows) -> None:
            for (w, fn), (k, _) in zip(variant, layers):
                fn(inputs[k], w)

        times = [[] for _ in variants]
        for _ in range(args.repeats):
            for t, variant in zip(times, variants):
                t.append(per_call_ms(lambda: step(variant), seconds=0.2))
        med = [statistics.median(t) for t in times]
        lines.append(f"| {rows} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {med[2] / med[0]:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
