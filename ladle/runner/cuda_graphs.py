"""CUDA graphs for decode-only steps: the forward and logits of up to max_batch one-token requests replayed
from a graph, so a decode step costs one launch instead of a few hundred (at batch 1 on an 8B model the
launches take longer than reading the weights).

A step of n decodes runs the graph captured for the smallest batch size >= n. The padding rows get slot -1
(the KV write skips them) and context length 0 (attention reads nothing for them); their logits are
discarded. Attention must be the Triton backend: the launch needs no host data beyond shapes, so its grid
is fixed per batch size. The inputs take the eager path's own route (ladle.runner.inputs.fill_inputs), padded
(ladle.runner.step_layout.pad_decodes) into static buffers of the runner's StepBuffers. Without capture (on
CPU) the same padded inputs run eagerly, which is how the padding is tested without a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ladle.attention.groups import AttentionGroup
from ladle.models.interface import CausalLM
from ladle.runner.inputs import StepInputs, fill_inputs, reserve_inputs
from ladle.runner.step_batch import StepBatch
from ladle.runner.step_buffers import StepBuffers
from ladle.runner.step_layout import StepLayout, empty_layout, lay_out, pad_decodes

# Dense where batches are common, sparser above; each size costs one capture at startup.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # the graph's output buffer, overwritten by every replay


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


def capture_sizes(sizes: tuple[int, ...], inputs_for: Callable[[int], StepInputs],
                  forward: Callable[[StepInputs], torch.Tensor], device: torch.device,
                  pool: Any = None) -> tuple[dict[int, Captured], Any]:
    """forward over inputs_for(size) captured for every size, largest first, into one memory pool (smaller
    graphs reuse its blocks); returns the graphs and the pool."""
    graphs: dict[int, Captured] = {}
    for size in sorted(sizes, reverse=True):
        inputs = inputs_for(size)
        graphs[size] = capture_graph(partial(forward, inputs), device, pool)
        pool = graphs[size].graph.pool()
    torch.cuda.synchronize(device)
    return graphs, pool


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, ...]], block_size: int,
        max_model_len: int, max_batch: int, device: torch.device, groups: tuple[AttentionGroup, ...],
        buffers: StepBuffers | None = None,
    ) -> None:
        """groups: the runner's paged KV cache groups with their backends; buffers: the runner's (a set of its
        own if None), where the static inputs live."""
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.groups = groups
        self.compressions = tuple(g.compression for g in groups)
        self.sizes = tuple(b for b in BATCH_SIZES if b < max_batch) + (max_batch,)
        self.width = -(-max_model_len // block_size)
        self.buffers = buffers or StepBuffers(device)
        reserve_inputs(self.buffers, _PREFIX, max_batch, max_batch, self.width, len(groups))
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

    def _fill(self, layout: StepLayout, rows: int) -> StepInputs:
        return fill_inputs(pad_decodes(layout, rows), self.buffers, self.block_size, self.groups,
                           prefix=_PREFIX)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_groups)
        logits = self.model.compute_logits(hidden)
        assert logits is not None  # the graphs run on the driver rank (ladle.executor), which gets the logits
        return logits

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every batch size into one memory pool; returns the pool. Each capture's inputs are padding
        only (slot -1, context 0): it writes no KV and reads none."""
        empty = empty_layout(len(self.groups))
        self.graphs, pool = capture_sizes(self.sizes, lambda n: self._fill(empty, n), self._forward, self.device,
                                          pool)
        return pool

    @torch.inference_mode()
    def run(
        self, step: StepBatch, tables: tuple[torch.Tensor, ...] | None = None, input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [len(step), vocab] of a decode-only step. tables: the step's host block table per group
        when the caller keeps them; input_ids: its input tokens when they are still on the device (a step
        launched before its inputs were read). On the graph path the result is a view of the graph's output
        buffer: sample from it before the next step replays the graph."""
        if not self.can_run(step):
            raise ValueError("DecodeGraphs runs decode-only steps of at most max_batch requests")
        n = len(step)
        batch = self.bucket(n)
        inputs = self._fill(lay_out(step, self.block_size, self.compressions, tables), batch)
        if input_ids is not None:  # device to device, ordered after the step that produced them; padding rows
            # only feed rows whose logits are dropped
            inputs.input_ids[:n].copy_(input_ids, non_blocking=True)
        captured = self.graphs.get(batch)
        if captured is None:
            return self._forward(inputs)[:n]
        captured.graph.replay()
        return captured.output[:n]


_PREFIX = "decode_graph."
