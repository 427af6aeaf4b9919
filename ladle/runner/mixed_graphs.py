"""CUDA graphs for steps that carry a prefill chunk: the forward of up to max_tokens tokens replayed from a
graph captured for a padded token count (vLLM captures such steps piecewise, around attention; ladle's Triton
attention needs only shapes from the host, so the whole forward is captured).

A step of T tokens from n requests (not all single decodes: those take DecodeGraphs) runs the graph of the
smallest captured size B >= T, with room for B requests at most (and max_num_seqs + 1). Its B - T padding
tokens form one extra request: slots -1 (its KV is never written), positions 0.., a block table of block 0
(which it reads, and nobody uses what it computes), so every row the graph computes is finite; the requests
after it have no tokens. The graph ends at the hidden states: the logits of the sampled rows are computed
eagerly from them, as vLLM does. Without capture (on CPU) the same padded buffers run eagerly, which is how
the padding is tested without a GPU.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ladle.attention.backends import AttentionBackend
from ladle.attention.metadata import AttentionMetadata
from ladle.runner.cuda_graphs import Captured, capture_graph, fill
from ladle.runner.inputs import StepBatch, slot_mapping, table_from_lists, token_layout

# Each size costs one capture at startup; steps above the largest run eagerly (they are compute-bound).
TOKEN_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class MixedGraphs:
    def __init__(
        self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
        max_model_len: int, max_tokens: int, max_num_seqs: int, device: torch.device, backend: AttentionBackend,
        window: int | None = None,
    ) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.backend, self.window = backend, window  # the model's one KV cache group's backend and window
        self.sizes = tuple(t for t in TOKEN_SIZES if t < max_tokens) + (max_tokens,)
        self.max_requests = max_num_seqs + 1  # and one for the padding tokens
        t, s, self.width = max_tokens, self.requests_for(max_tokens), -(-max_model_len // block_size)
        # Static buffers: a graph reads them at fixed addresses, so each step copies its inputs in.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, self.width, dtype=torch.int32, device=device)
        self.graphs: dict[int, Captured] = {}

    def requests_for(self, tokens: int) -> int:
        """Request rows of the graph for this many tokens: every one could be a request of its own."""
        return min(tokens, self.max_requests)

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.sizes if b >= tokens)

    def can_run(self, step: StepBatch) -> bool:
        """A step with a prefill chunk (so fewer requests than tokens) within the largest captured size."""
        return (len(step.token_ids) <= self.sizes[-1] and not step.is_decode_only
                and len(step) < self.max_requests
                and max(p + n for p, n in zip(step.start_pos, step.num_tokens)) <= self.width * self.block_size)

    def _metadata(self, tokens: int, query_lens: tuple[int, ...], context_host: tuple[int, ...]) -> AttentionMetadata:
        s = len(query_lens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], cu_seqlens_q=self.cu_seqlens_q[: s + 1],
            context_lens=self.context_lens[:s], block_tables=self.block_tables[:s], query_lens=query_lens,
            context_lens_host=context_host, block_size=self.block_size, sliding_window=self.window,
            backend=self.backend,
        )

    def _forward(self, tokens: int, query_lens: tuple[int, ...], context_host: tuple[int, ...]) -> torch.Tensor:
        meta = self._metadata(tokens, query_lens, context_host)
        return self.model(self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every size, largest first, into one memory pool; returns the pool. Each capture's step is
        padding alone, one request of the whole size: it writes no KV and reads block 0."""
        for b in sorted(self.sizes, reverse=True):
            s = self.requests_for(b)
            self._fill(StepBatch([], [], [], [], [], []), b, None)
            lens = (b,) + (0,) * (s - 1)  # any lengths with a maximum above 1: the prefill kernel's tiles
            self.graphs[b] = capture_graph(lambda: self._forward(b, lens, lens), self.device, pool)
            pool = self.graphs[b].graph.pool()
        torch.cuda.synchronize(self.device)
        return pool

    def _fill(self, step: StepBatch, size: int, table: torch.Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Copy a step's inputs into the buffers, padded to `size` tokens; returns its padded query and context
        lengths (host copies for eager runs). table: the step's host block table (else from the lists)."""
        n, bs, t = len(step), self.block_size, len(step.token_ids)
        s, pad = self.requests_for(size), size - t
        starts = np.array(step.start_pos, dtype=np.int64)
        cu, request, real_positions = token_layout(starts, np.array(step.num_tokens, dtype=np.int64))
        ids = np.zeros(size, dtype=np.int64)
        ids[:t] = step.token_ids
        positions = np.empty(size, dtype=np.int64)
        positions[:t] = real_positions
        positions[t:] = np.arange(pad)
        rows = (table_from_lists([b[0] for b in step.block_ids], -(-(starts + np.diff(cu)) // bs))
                if table is None else table.numpy())
        slots = np.full(size, -1, dtype=np.int64)
        slots[:t] = slot_mapping(rows, request, real_positions, bs)
        full_cu = np.full(s + 1, size, dtype=np.int32)
        full_cu[: n + 1] = cu
        context = np.zeros(s, dtype=np.int32)
        context[:n] = starts + np.diff(cu)
        if pad:
            context[n] = pad
        table_rows = np.zeros((n + 1, max(rows.shape[1], -(-pad // bs), 1)), dtype=np.int32)
        table_rows[:n, : rows.shape[1]] = rows
        for dst, values in ((self.input_ids, ids), (self.positions, positions), (self.slot_mapping, slots),
                            (self.cu_seqlens_q, full_cu), (self.context_lens, context),
                            (self.block_tables, table_rows)):
            fill(dst, values)
        query_lens = tuple(np.diff(full_cu).tolist())
        return query_lens, tuple(context.tolist())

    @torch.inference_mode()
    def run(self, step: StepBatch, table: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [len(step.token_ids), hidden] of a step with a prefill chunk. On the graph path the
        result is a view of the graph's output buffer: take what is needed before the next replay."""
        if not self.can_run(step):
            raise ValueError("MixedGraphs runs steps with a prefill chunk of at most its largest size")
        t = len(step.token_ids)
        size = self.bucket(t)
        query_lens, context_host = self._fill(step, size, table)
        captured = self.graphs.get(size)
        if captured is None:
            return self._forward(size, query_lens, context_host)[:t]
        captured.graph.replay()
        return captured.output[:t]
