"""Decode attention on CPU: the torch reference (gather each request's context from the paged pool, then the
CPU flash kernel) against ladle's C kernel (ladle.attention.cpu_attention, the pool read in place), one thread,
for batches of decodes at several contexts, blocks scattered through the pool as a busy server leaves them.
Each cell is the median of interleaved repeats of one layer's call (KV write included).

    python benchmarks/cpu_decode_attention.py --out benchmarks/results/cpu_decode_attention.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command, machine, per_call_ms, write_markdown  # noqa: E402

from ladle.attention import torch_ref  # noqa: E402
from ladle.attention.cpu_attention import CpuAttention  # noqa: E402
from ladle.attention.metadata import AttentionMetadata  # noqa: E402
from ladle.kernels.cpu_kernels import load  # noqa: E402

BLOCK = 16


def decode_step(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    width = -(-context // BLOCK)
    num_blocks = batch * width * 2
    tables = torch.randperm(num_blocks)[: batch * width].view(batch, width).to(torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK].long() * BLOCK + last % BLOCK
    attn = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                             context_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
                             query_lens=(1,) * batch, context_lens_host=(context,) * batch, block_size=BLOCK)
    pool = [torch.randn(num_blocks, BLOCK, kv_heads, head_dim).to(dtype) for _ in range(2)]
    new = [torch.randn(batch, n, head_dim).to(dtype) for n in (heads, kv_heads, kv_heads)]
    return new[0], new[1], new[2], pool[0], pool[1], attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--heads", type=int, nargs=3, default=[8, 4, 64], metavar=("HEADS", "KV_HEADS", "HEAD_DIM"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    heads, kv_heads, head_dim = args.heads
    cpu = CpuAttention(load())
    lines = ["## Decode attention on CPU: torch reference vs ladle's C kernel", "", f"Reproduce: `{command()}`", "",
             f"{heads} query heads over {kv_heads} kv heads x {head_dim}, block size {BLOCK}, blocks scattered; one "
             f"layer's call, ms (median of {args.repeats} interleaved repeats), 1 thread; machine: "
             f"{machine()['cpus']} CPUs, torch {machine()['torch']}.", "",
             "| dtype | decodes | context | torch (gather + flash) | C kernel | speed-up |", "|---|---:|---:|---:|---:|---:|"]
    for dtype in (torch.float32, torch.bfloat16):
        for batch in args.batches:
            for context in args.contexts:
                step = decode_step(batch, context, heads, kv_heads, head_dim, dtype)
                scale = head_dim**-0.5
                fns = [lambda: torch_ref.paged_attention(*step, scale), lambda: cpu(*step, scale)]
                seconds = 0.05 + batch * context / 2e6
                times: list[list[float]] = [[], []]
                for _ in range(args.repeats):
                    for t, fn in zip(times, fns):
                        t.append(per_call_ms(fn, seconds))
                ref, c = (statistics.median(t) for t in times)
                lines.append(f"| {str(dtype).removeprefix('torch.')} | {batch} | {context} | {ref:.3f} | {c:.3f} | "
                             f"{ref / c:.1f}x |")
                print(lines[-1], flush=True)
    write_markdown(lines, args.out)


if __name__ == "__main__":
    main()
