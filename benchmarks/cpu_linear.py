"""CPU linear layers by row count: torch's F.linear (row-major weight, MKL), oneDNN's pre-packed weight (the
fallback without a C compiler, as vLLM's CPU backend runs its linears) and ladle's skinny_linear C kernel
(ladle.models.layers.cpu_linear.CpuLinear), one thread, on the shapes of a model's layers and head. Each cell is the
median of interleaved repeats. The first table calls one weight again and again (hot in cache: per-call costs);
the second runs every linear of the model once per step, as a decode step does, so the weights stream from
memory, in float32 and in bfloat16 (where oneDNN cannot pack bf16 on this CPU, its column is empty).

    python benchmarks/cpu_linear.py --model-name qwen3-512 --out benchmarks/results/cpu_linear.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, command, machine, per_call_ms, write_markdown  # noqa: E402

from ladle.kernels.cpu_kernels import load  # noqa: E402
from ladle.models.layers.cpu_linear import CpuLinear, pack, packed_linear  # noqa: E402

Linear = Callable[[torch.Tensor], torch.Tensor]


def variants(weight: torch.Tensor) -> list[Linear | None]:
    """F.linear, oneDNN-packed (None where it cannot pack), skinny_linear; each always takes its own path."""
    packed = pack(weight)
    skinny = CpuLinear(weight, None, load())
    skinny.max_rows = 1 << 62
    return [lambda x: F.linear(x, weight),
            None if packed is None else (lambda x: packed_linear(x, packed, None)),
            skinny]


def medians(fns: list[Linear | None], run: Callable[[Linear], None], repeats: int, seconds: float) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            if fn is not None:
                t.append(per_call_ms(lambda: run(fn), seconds))
    return [statistics.median(t) if t else float("nan") for t in times]


def row(cells: list[str], med: list[float]) -> str:
    fmt = [f"{v:.3f}" if v == v else "-" for v in med]
    best = min(v for v in med[:2] if v == v)
    return "| " + " | ".join(cells + fmt + [f"{med[2] / best:.2f}"]) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-512")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = MODELS[args.model_name]
    h, inter, heads, kv, hd = (m["hidden_size"], m["intermediate_size"], m["num_attention_heads"],
                               m["num_key_value_heads"], m["head_dim"])
    shapes = {"qkv": (h, (heads + 2 * kv) * hd), "o": (heads * hd, h), "gate_up": (h, 2 * inter),
              "down": (inter, h), "head": (h, m["vocab_size"])}
    head = "| F.linear | oneDNN packed | skinny_linear | skinny / best other |"
    lines = ["## CPU linear layers: F.linear, oneDNN-packed, ladle's skinny_linear", "", f"Reproduce: `{command()}`",
             "", f"`{args.model_name}` shapes, 1 thread, ms per call (median of {args.repeats} interleaved repeats); "
             f"machine: {machine()['cpus']} CPUs, torch {machine()['torch']}. The last column below 1 is ladle's "
             "kernel faster than the better of the other two. CpuLinear uses the kernel up to 24 rows in float32 "
             "(for any row count in bfloat16 where oneDNN cannot pack it) and F.linear above.", "",
             "float32, one weight called again and again (in cache):", "",
             "| layer | in x out | rows " + head, "|---|---|---:|---:|---:|---:|---:|"]
    for name, (k, n) in shapes.items():
        fns = variants(torch.randn(n, k) / k**0.5)
        for rows in args.rows:
            x = torch.randn(rows, k)
            lines.append(row([name, f"{k} x {n}", str(rows)], medians(fns, lambda fn: fn(x), args.repeats, 0.03)))
            print(lines[-1], flush=True)
    layers = [shapes[k] for k in ("qkv", "o", "gate_up", "down")] * m["num_hidden_layers"] + [shapes["head"]]
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        lines += ["", f"Every linear of `{args.model_name}` once per step in {name} ({m['num_hidden_layers']} layers "
                  "and the head, weights streamed from memory), ms per step:", "", "| rows " + head,
                  "|---:|---:|---:|---:|---:|"]
        per_layer = [variants((torch.randn(n, k) / k**0.5).to(dtype)) for k, n in layers]
        fns = [None if any(v[i] is None for v in per_layer) else i for i in range(3)]
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).to(dtype) for k, _ in layers}

            def step(i: int) -> None:
                for v, (k, _) in zip(per_layer, layers):
                    v[i](inputs[k])

            lines.append(row([str(rows)], medians(fns, step, args.repeats, 0.2)))
            print(lines[-1], flush=True)
    write_markdown(lines, args.out)


if __name__ == "__main__":
    main()
