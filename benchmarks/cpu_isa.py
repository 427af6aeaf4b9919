"""ladle's CPU paths at each instruction-set level this CPU runs (ladle.kernels.cpu_isa), side by side in one run.

1. Kernels: every linear of the model once per step (weights streamed from memory, as a decode step reads them),
   ms per step, through skinny_linear as built for each level, beside oneDNN's packed weights (torch's matmul at
   this CPU's own level, the path vLLM's CPU backend takes) and F.linear.
2. The engine, one process per level and dtype with LADLE_CPU_ISA set (oneDNN capped with it): TTFT of one
   512-token prompt, batch-1 decode (ITL p50 over 128 tokens) and 16 requests x 128 tokens; the greedy tokens of
   every level are compared with the CPU's own level's.

    python benchmarks/cpu_isa.py --out benchmarks/results/cpu_isa.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, build_model, command, cpu_name, machine, per_call_ms  # noqa: E402

from ladle.kernels.cpu_isa import ENV, CpuIsa, cpu_flags, detect, kernel_levels, supported  # noqa: E402
from ladle.kernels.cpu_kernels import load  # noqa: E402
from ladle.models.layers.cpu_linear import CpuLinear, pack, packed_linear  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernel_table(model_name: str, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    """ms per step for each (dtype, rows): every peer and every level, interleaved within each repeat."""
    m = MODELS[model_name]
    h, inter, heads, kv, hd = (m["hidden_size"], m["intermediate_size"], m["num_attention_heads"],
                               m["num_key_value_heads"], m["head_dim"])
    shapes = [(h, (heads + 2 * kv) * hd), (heads * hd, h), (h, 2 * inter), (inter, h)] * m["num_hidden_layers"]
    shapes.append((h, m["vocab_size"]))
    levels = kernel_levels()
    out = []
    for dtype_name, dtype in DTYPES.items():
        weights = [(torch.randn(n, k) / k**0.5).to(dtype) for k, n in shapes]
        packed = [pack(w) for w in weights]
        paths: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
        if all(p is not None for p in packed):
            paths["oneDNN packed"] = [lambda x, p=p: packed_linear(x, p, None) for p in packed]
        for level in levels:
            kernels = load(level)
            layers = [CpuLinear(w, None, kernels) for w in weights]
            for layer in layers:
                layer.max_rows = 1 << 62
            paths[f"skinny {level.label}"] = layers
        for n_rows in rows:
            inputs = {k: torch.randn(n_rows, k).to(dtype) for k, _ in shapes}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(repeats):
                for name, fns in paths.items():
                    times[name].append(per_call_ms(lambda fns=fns: [fn(inputs[k]) for fn, (k, _) in zip(fns, shapes)],
                                                   0.3))
            row = {"dtype": dtype_name, "rows": n_rows, **{name: statistics.median(t) for name, t in times.items()}}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def worker(model_dir: str, dtype: str, repeats: int) -> dict[str, Any]:
    """One engine at this process's level: the three measures, medians over repeats, and its greedy tokens."""
    from ladle import LLM
    from ladle.entrypoints.bench import Workload, random_workload, run_ladle_offline

    llm = LLM(model_dir, dtype=dtype)
    engine, vocab = llm.engine, 32000
    run_ladle_offline(engine, random_workload(2, (64, 64), (8, 8), vocab, 0))  # warm up
    runs: dict[str, list[float]] = {"ttft_512_ms": [], "decode_itl_ms": [], "batch16_output_tok_s": []}
    for i in range(repeats):  # new prompts each repeat: a prefix-cache hit would skip the prefill
        seed = 10 * (i + 1)
        prefill = Workload(random_workload(1, (512, 512), (1, 1), vocab, seed).prompts, [1])
        runs["ttft_512_ms"].append(run_ladle_offline(engine, prefill)["ttft_ms"]["median"])
        single = random_workload(1, (16, 16), (128, 128), vocab, seed + 1)
        runs["decode_itl_ms"].append(run_ladle_offline(engine, single)["itl_ms"]["median"])
        batch = random_workload(16, (64, 64), (128, 128), vocab, seed + 2)
        runs["batch16_output_tok_s"].append(run_ladle_offline(engine, batch)["output_tok_per_s"])
    tokens = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in batch.prompts[:4]], greedy_params(), use_tqdm=False)]
    settings = llm.config.settings
    return {**{k: statistics.median(v) for k, v in runs.items()}, "runs": runs, "tokens": tokens,
            "cpu_isa": f"{settings['cpu_isa'].value} ({settings['cpu_isa'].reason})",
            "cpu_kernels": settings["cpu_kernels"].reason}


def greedy_params() -> Any:
    from ladle import SamplingParams

    return SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def engine_table(model_dir: str, repeats: int) -> list[dict[str, Any]]:
    out = []
    for dtype in DTYPES:
        for level in supported(cpu_flags()):
            env = {**os.environ, ENV: level.label}
            env.pop("ONEDNN_MAX_CPU_ISA", None)
            proc = subprocess.run([sys.executable, __file__, "--worker", model_dir, dtype, str(repeats)], env=env,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"the {level.label} {dtype} worker failed: {proc.stderr[-2000:]}")
            row = {"dtype": dtype, "level": level.label, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps({k: v for k, v in row.items() if k not in ("runs", "tokens")}), flush=True)
            out.append(row)
    native = detect(cpu_flags()).label
    for row in out:
        same = next(r for r in out if r["dtype"] == row["dtype"] and r["level"] == native)
        row["tokens_equal_native"] = row["tokens"] == same["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-name", default="qwen3-768")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernel-threads", type=int, default=1)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "DTYPE", "REPEATS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]))))
        return
    result: dict[str, Any] = {"command": command(), "cpu": cpu_name(), "machine": machine(),
                              "model": args.model_name, "levels": [lv.label for lv in supported(cpu_flags())]}
    if not args.skip_kernels:
        torch.set_num_threads(args.kernel_threads)
        result["kernel_threads"] = args.kernel_threads
        result["kernels"] = kernel_table(args.model_name, args.rows, args.repeats)
        torch.set_num_threads(os.cpu_count() or 1)
    result["engine"] = engine_table(build_model(args.model_name), args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
