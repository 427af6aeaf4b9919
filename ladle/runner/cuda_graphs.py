"""CUDA graphs for decode-only steps: the forward and logits of up to max_batch one-token requests replayed
from a graph, so a decode step costs one launch instead of a few hundred (at batch 1 on an 8B model the
launches take longer than reading the weights).

A step of n decodes runs the graph captured for the smallest batch size >= n. The padding rows get slot -1
(the KV write skips them) and context length 0 (attention reads nothing for them); their logits are
discarded. Attention must be the Triton backend: the launch needs no host data beyond shapes, so its grid
is fixed per batch size. Without capture (capture=False, or on CPU) the same padded buffers run eagerly,
which is how the padding logic is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ladle.attention.backends import AttentionBackend
from ladle.attention.metadata import AttentionMetadata
from ladle.runner.inputs import StepBatch, table_from_lists

# Dense where batches are common, sparser above; each size costs one capture at startup.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the graph's output buffer, overwritten by every replay


def fill(dst: torch.Tensor, values: np.ndarray) -> None:
    """values into the leading rows (and columns) of a graph's static buffer; from pinned memory on CUDA, so
    the copy is a true async DMA."""
    src = torch.from_numpy(values)
    view = dst[: values.shape[0], : values.shape[1]] if values.ndim == 2 else dst[: len(values)]
    view.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)


def capture_graph(forward: Callable[[], torch.Tensor], device: torch.device, pool: Any = None) -> Captured:
    """forward captured into a graph whose memory comes from `pool` (None: a new one; graph.graph.pool()
    hands it on, so graphs replayed one at a time share their blocks)."""
    # Warm up on a side stream first (lazy inits, Triton compiles, cuBLAS workspaces), as torch asks.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return Captured(graph, output)


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
        max_model_len: int, max_batch: int, device: torch.device, backend: AttentionBackend,
        window: int | None = None,
    ) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.backend, self.window = backend, window  # the model's one KV cache group's backend and window
        self.sizes = tuple(b for b in BATCH_SIZES if b < max_batch) + (max_batch,)
        n, self.width = max_batch, -(-max_model_len // block_size)
        # Static buffers: a graph reads them at fixed addresses, so each step copies its inputs in.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each, always
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.graphs: dict[int, Captured] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def can_run(self, batch: StepBatch) -> bool:
        """A decode-only step (every request one sampled token) within the largest captured batch."""
        return (0 < len(batch) <= self.max_batch and batch.is_decode_only
                and max(batch.start_pos) < self.width * self.block_size)

    def _metadata(self, n: int, context_host: tuple[int, ...]) -> AttentionMetadata:
        # Host context lengths matter only to the CPU reference backend, which eager runs may use.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            context_lens=self.context_lens[:n], block_tables=self.block_tables[:n],
            query_lens=(1,) * n, context_lens_host=context_host, block_size=self.block_size, sliding_window=self.window,
            backend=self.backend,
        )

    def _forward(self, n: int, context_host: tuple[int, ...] | None = None) -> torch.Tensor:
        meta = self._metadata(n, context_host or (0,) * n)
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every batch size, largest first, into one memory pool (smaller graphs reuse its blocks);
        returns the pool. The buffers hold padding only (slot -1, context 0), so capture writes no KV and
        reads none."""
        self._fill(StepBatch([], [], [], [], [], []), self.max_batch)
        for n in sorted(self.sizes, reverse=True):
            self.graphs[n] = capture_graph(lambda: self._forward(n), self.device, pool)
            pool = self.graphs[n].graph.pool()
        torch.cuda.synchronize(self.device)
        return pool

    def _fill(
        self, step: StepBatch, batch: int, table: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
    ) -> None:
        """Copy a step's inputs into rows [0, len(step)) and padding into the rest, up to `batch` rows.
        table: the step's host block table when the caller keeps one (else built from the block id lists).
        input_ids: the input tokens already on the device (a step launched before its inputs were read)."""
        n, bs = len(step), self.block_size
        pos = np.zeros(batch, dtype=np.int64)
        pos[:n] = step.start_pos
        if table is None:
            # One KV cache group: the engine keeps CUDA (and so graphs) to full-attention models with one group.
            host = table_from_lists([t[0] for t in step.block_ids], pos[:n] // bs + 1)
        else:
            host = table.numpy()
        slots = np.full(batch, -1, dtype=np.int64)
        slots[:n] = host[np.arange(n), pos[:n] // bs].astype(np.int64) * bs + pos[:n] % bs
        context = np.zeros(batch, dtype=np.int32)
        context[:n] = pos[:n] + 1
        if input_ids is None:
            ids = np.zeros(batch, dtype=np.int64)
            ids[:n] = step.token_ids
            fill(self.input_ids, ids)
        else:  # device to device, ordered after the step that produced them; padding rows only feed rows
            # whose logits are dropped, so their stale ids may stay
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        fill(self.positions, pos)
        fill(self.slot_mapping, slots)
        fill(self.context_lens, context)
        # Only the rows and columns this step reads are copied: the buffer spans max_model_len (8K blocks at
        # 128K context); padding rows have context 0, and nothing past a context length is ever read.
        fill(self.block_tables, host)

    @torch.inference_mode()
    def run(
        self, step: StepBatch, table: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [len(step), vocab] of a decode-only step. On the graph path the result is a view of
        the graph's output buffer: sample from it before the next step replays the graph."""
        if not self.can_run(step):
            raise ValueError("DecodeGraphs runs decode-only steps of at most max_batch requests")
        n = len(step)
        batch = self.bucket(n)
        self._fill(step, batch, table, input_ids)
        captured = self.graphs.get(batch)
        if captured is None:
            context = tuple(p + 1 for p in step.start_pos) + (0,) * (batch - n)
            return self._forward(batch, context)[:n]
        captured.graph.replay()
        return captured.output[:n]
