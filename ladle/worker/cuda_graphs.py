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

import torch

from ladle.attention.backends import AttentionBackend
from ladle.attention.metadata import AttentionMetadata
from ladle.worker.inputs import ScheduledChunk

# Dense where batches are common, sparser above; each size costs one capture at startup.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output buffer [batch, vocab], overwritten by every replay


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
        max_model_len: int, max_batch: int, device: torch.device, backend: AttentionBackend,
    ) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.backend = backend  # the model's one KV cache group's attention backend
        self.sizes = tuple(b for b in BATCH_SIZES if b < max_batch) + (max_batch,)
        n, self.width = max_batch, -(-max_model_len // block_size)
        # Static buffers: a graph reads them at fixed addresses, so each step copies its inputs in.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each, always
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Captured] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        """A decode-only step (every request one sampled token) within the largest captured batch."""
        return 0 < len(chunks) <= self.max_batch and all(
            len(c.token_ids) == 1 and c.sample and c.start_pos < self.width * self.block_size for c in chunks
        )

    def _metadata(self, n: int, context_host: tuple[int, ...]) -> AttentionMetadata:
        # Host context lengths matter only to the CPU reference backend, which eager runs may use.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            context_lens=self.context_lens[:n], block_tables=self.block_tables[:n],
            query_lens=(1,) * n, context_lens_host=context_host, block_size=self.block_size, backend=self.backend,
        )

    def _forward(self, n: int, context_host: tuple[int, ...] | None = None) -> torch.Tensor:
        meta = self._metadata(n, context_host or (0,) * n)
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, into one memory pool (smaller graphs reuse its blocks).
        The buffers hold padding only (slot -1, context 0), so capture writes no KV and reads none."""
        self._fill([], self.max_batch)
        pool = None
        for n in sorted(self.sizes, reverse=True):
            # Warm up on a side stream first (lazy inits, Triton compiles, cuBLAS workspaces), as torch asks.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(n)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = _Captured(graph, logits)
        torch.cuda.synchronize(self.device)

    def _fill(
        self, chunks: list[ScheduledChunk], batch: int, table: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> None:
        """Copy a step's inputs into rows [0, len(chunks)) and padding into the rest, up to `batch` rows.
        table: the step's host block table when the caller keeps one (else built from the chunks).
        input_ids: the input tokens already on the device (a step launched before its inputs were read)."""
        n, bs = len(chunks), self.block_size
        pad = batch - n
        pos = [c.start_pos for c in chunks]
        # One KV cache group: the engine keeps CUDA (and so graphs) to full-attention models with one group.
        slots = [c.block_ids[0][p // bs] * bs + p % bs for c, p in zip(chunks, pos)]
        pin = self.device.type == "cuda"  # pinned host memory makes the copies true async DMAs
        if table is None:
            rows = [c.block_ids[0][: p // bs + 1] for c, p in zip(chunks, pos)]
            width = max((len(r) for r in rows), default=1)
            table = torch.tensor([r + [0] * (width - len(r)) for r in rows] or [[0]], dtype=torch.int32)
        # Only the rows and columns this step reads are copied: the buffer spans max_model_len (8K blocks at
        # 128K context); padding rows have context 0, and nothing past a context length is ever read.
        rows_n, width = table.shape

        def put(dst: torch.Tensor, values: list[int], fill: int) -> None:
            host = torch.tensor(values + [fill] * pad, dtype=dst.dtype)
            dst[:batch].copy_(host.pin_memory() if pin else host, non_blocking=True)

        if input_ids is None:
            put(self.input_ids, [c.token_ids[0] for c in chunks], 0)
        else:  # device to device, ordered after the step that produced them; padding rows only feed rows
            # whose logits are dropped, so their stale ids may stay
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        put(self.positions, pos, 0)
        put(self.slot_mapping, slots, -1)
        put(self.context_lens, [p + 1 for p in pos], 0)
        self.block_tables[:rows_n, :width].copy_(table.pin_memory() if pin else table, non_blocking=True)

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], table: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [len(chunks), vocab] of a decode-only step. On the graph path the result is a view of
        the graph's output buffer: sample from it before the next step replays the graph."""
        if not self.can_run(chunks):
            raise ValueError("DecodeGraphs runs decode-only steps of at most max_batch requests")
        batch = self.bucket(len(chunks))
        self._fill(chunks, batch, table, input_ids)
        captured = self.graphs.get(batch)
        if captured is None:
            context = tuple(c.start_pos + 1 for c in chunks) + (0,) * (batch - len(chunks))
            return self._forward(batch, context)[: len(chunks)]
        captured.graph.replay()
        return captured.logits[: len(chunks)]
