"""Predicted vs measured activation peak, and peak vs context length at a fixed chunk.

Usage: python benchmarks/planner_accuracy.py [--model DIR] [--out benchmarks/results/planner.md]
Without --model it builds the demo model into a temp dir. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from ladle.config.engine_args import EngineArgs
from ladle.demo import build_demo_model
from ladle.startup.profiling import profile_points
from ladle.startup.setup import load_and_plan

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = args.model or build_demo_model(Path(tempfile.mkdtemp()) / "demo")
    engine_args, explicit = EngineArgs.from_kwargs(model=model_dir)
    loaded = load_and_plan(engine_args, explicit)
    act = loaded.config.plan.inputs.activation
    cfg = loaded.hf_config
    max_len = loaded.config.max_model_len
    lines = [f"Model: {model_dir} (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size})",
             f"Fitted: {act.describe()}", "",
             "| chunk | context | measured MiB | predicted MiB | predicted / measured |", "|---|---|---|---|---|"]
    layout = loaded.config.kv_layout
    check = profile_points(loaded.model, layout, loaded.config.device, cfg.vocab_size, [256, 1024, 4096], max_len,
                           [32])
    for p in (p for p in check if p.kind == "prefill"):
        pred = act.predict_prefill(p.num_tokens, p.context)
        lines.append(f"| {p.num_tokens} | {p.context} | {p.peak / MiB:.2f} | {pred / MiB:.2f} | {pred / p.peak:.3f} |")
    lines += ["", "| chunk | context | measured peak MiB | ratio to context 2048 |", "|---|---|---|---|"]
    base = None
    for ctx in (2048, 4096, max_len):
        pts = profile_points(loaded.model, layout, loaded.config.device, cfg.vocab_size, [512], ctx, [1])
        peak = max(p.peak for p in pts if p.kind == "prefill" and p.context == ctx)
        base = base or peak
        lines.append(f"| 512 | {ctx} | {peak / MiB:.2f} | {peak / base:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
