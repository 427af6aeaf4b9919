"""Host time per decode step, which a GPU replaying a CUDA graph waits for (the engine loop is synchronous).

256 decodes at contexts 2K / 8K / 32K (block size 16): the eager builder (`build_step_inputs`) and the
CUDA-graph buffers' fill (`DecodeGraphs._fill`, run on CPU tensors: the same host work, minus the pinned
copy), each with the step's block table rebuilt from Python lists vs taken from the persistent
`BlockTableBuffer`. Then the whole `EngineCore.step()` of 256 running decodes with the model replaced by a
stub that returns zeros: scheduling, inputs, sampling and output bookkeeping, everything but the model.
Median of 5 runs of 20 steps; run with OMP_NUM_THREADS=1.

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ladle.worker.block_table import BlockTableBuffer
from ladle.attention.backends import TorchAttention
from ladle.worker.cuda_graphs import DecodeGraphs
from ladle.worker.inputs import ScheduledChunk, build_step_inputs

BLOCK = 16
MAX_MODEL_LEN = 131072


def median_ms(fn: Callable[[], object], steps: int = 20, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def measure(batch: int, context: int) -> list[float]:
    blocks = -(-(context + 1) // BLOCK)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    chunks = [ScheduledChunk([7], context, tables[i], True) for i in range(batch)]
    ids, widths = [f"r{i}" for i in range(batch)], [blocks] * batch
    buffer = BlockTableBuffer(2 * batch, MAX_MODEL_LEN // BLOCK)
    graphs = DecodeGraphs(torch.nn.Module(), [], BLOCK, MAX_MODEL_LEN, batch, torch.device("cpu"), TorchAttention())
    return [
        median_ms(lambda: build_step_inputs(chunks, BLOCK)),
        median_ms(lambda: build_step_inputs(chunks, BLOCK, "cpu", (buffer.gather(ids, tables, widths),))),
        median_ms(lambda: graphs._fill(chunks, batch)),
        median_ms(lambda: graphs._fill(chunks, batch, buffer.gather(ids, tables, widths))),
    ]


def engine_step_ms(batch: int, context: int, workdir: str) -> tuple[float, float]:
    """One EngineCore.step() of `batch` decodes at `context` tokens, model stubbed out: the host's share,
    with the persistent block tables and with tables rebuilt from lists each step."""
    from ladle.config import EngineArgs
    from ladle.demo import build_checkpoint
    from ladle.engine.core import EngineCore
    from ladle.sampling_params import SamplingParams

    path = build_checkpoint(workdir, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128,
                            max_position_embeddings=2 * context)
    per_request = -(-2 * context // BLOCK)
    args, explicit = EngineArgs.from_kwargs(model=path, max_num_batched_tokens=8192, max_num_seqs=batch,
                                            num_kv_blocks=batch * per_request)
    core = EngineCore(args, explicit)
    params = SamplingParams(temperature=0.0, max_tokens=context, ignore_eos=True)
    for i in range(batch):
        core.add_request(core.make_request(f"r{i}", [1 + (i + j) % 400 for j in range(context)], params))
    while any(r.is_prefilling for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    model, vocab = core.runner.model, core.hf_config.vocab_size
    model.forward = lambda ids, *_: torch.zeros(ids.shape[0], 64)
    model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], vocab)
    with_buffer = median_ms(core.step)
    core.runner.block_tables = None
    return with_buffer, median_ms(core.step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--out", default=None, help="write the markdown section here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lines = ["## Host time per decode step (persistent block tables)", "",
             f"{a.batch} decodes, block size {BLOCK}, ms per step (median of 5 x 20 steps, one thread, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}): what the device waits for between "
             "two CUDA-graph replays, before this change and after it. The tables do not grow during the "
             "measurement; in a real decode step 1 request in 16 adds a block, one small write each.", "",
             "| context | eager inputs, tables from lists | eager inputs, BlockTableBuffer | graph fill, from lists "
             "| graph fill, BlockTableBuffer |", "|---:|---:|---:|---:|---:|"]
    for ctx in a.contexts:
        row = measure(a.batch, ctx)
        lines.append(f"| {ctx:,} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
        print(lines[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        step, rebuilt = engine_step_ms(a.batch, 2048, tmp)
    lines += ["", f"Whole `EngineCore.step()` of {a.batch} decodes at 2,048 tokens with the model stubbed out "
              f"(scheduling, inputs, sampling, bookkeeping): **{step:.2f} ms** per step ({rebuilt:.2f} ms with "
              "the tables rebuilt from lists)."]
    print(lines[-1], flush=True)
    lines += ["", "Reproduce: `OMP_NUM_THREADS=1 python benchmarks/host_overhead.py --out "
              "benchmarks/results/host_overhead.md`", ""]
    if a.out:
        Path(a.out).write_text("\n".join(lines))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
