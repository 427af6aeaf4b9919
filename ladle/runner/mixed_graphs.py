"""CUDA graphs for steps that carry a prefill chunk: the forward of up to max_tokens tokens replayed from a
graph captured for a padded token count (vLLM captures such steps piecewise, around attention; ladle's Triton
attention needs only shapes from the host, so the whole forward is captured).

A step of T tokens from n requests (not all single decodes: those take DecodeGraphs) runs the graph of the
smallest captured size B >= T, with room for B requests at most (and max_num_seqs + 1). Its B - T padding
tokens form one extra request: slots -1 (its KV is never written), positions 0.., a block table of block 0
(which it reads, and nobody uses what it computes), so every row the graph computes is finite; the requests
after it have no tokens. The graph ends at the hidden states: the logits of the sampled rows are computed
eagerly from them, as vLLM does. The inputs take the eager path's own route (ladle.runner.inputs.fill_inputs),
padded (ladle.runner.step_layout.pad_tokens) into static buffers of the runner's StepBuffers. Without capture
(on CPU) the same padded inputs run eagerly, which is how the padding is tested without a GPU.
"""
from __future__ import annotations

from typing import Any

import torch

from ladle.attention.groups import AttentionGroup
from ladle.models.interface import CausalLM
from ladle.runner.cuda_graphs import Captured, capture_sizes
from ladle.runner.inputs import StepInputs, fill_inputs, reserve_inputs
from ladle.runner.step_batch import StepBatch
from ladle.runner.step_buffers import StepBuffers
from ladle.runner.step_layout import StepLayout, empty_layout, lay_out, pad_tokens

# Each size costs one capture at startup; steps above the largest run eagerly (they are compute-bound).
TOKEN_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_PREFIX = "mixed_graph."


class MixedGraphs:
    def __init__(
        self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, ...]], block_size: int,
        max_model_len: int, max_tokens: int, max_num_seqs: int, device: torch.device,
        groups: tuple[AttentionGroup, ...], buffers: StepBuffers | None = None,
    ) -> None:
        """groups: the runner's paged KV cache groups with their backends; buffers: the runner's (a set of its
        own if None), where the static inputs live."""
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.groups = groups
        self.compressions = tuple(g.compression for g in groups)
        self.sizes = tuple(t for t in TOKEN_SIZES if t < max_tokens) + (max_tokens,)
        self.max_requests = max_num_seqs + 1  # and one for the padding tokens
        self.width = -(-max_model_len // block_size)
        self.buffers = buffers or StepBuffers(device)
        reserve_inputs(self.buffers, _PREFIX, max_tokens, self.requests_for(max_tokens), self.width, len(groups))
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

    def _fill(self, layout: StepLayout, size: int) -> StepInputs:
        padded = pad_tokens(layout, size, self.requests_for(size), self.block_size)
        return fill_inputs(padded, self.buffers, self.block_size, self.groups, prefix=_PREFIX)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_groups)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every size into one memory pool; returns the pool. Each capture's step is padding alone, one
        request of the whole size (so the prefill kernel's tiles): it writes no KV and reads block 0."""
        empty = empty_layout(len(self.groups))
        self.graphs, pool = capture_sizes(self.sizes, lambda b: self._fill(empty, b), self._forward, self.device,
                                          pool)
        return pool

    @torch.inference_mode()
    def run(self, step: StepBatch, tables: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, StepInputs]:
        """Hidden states [len(step.token_ids), hidden] of a step with a prefill chunk, and the inputs they were
        computed from (their logits_indices pick the sampled rows). tables: the step's host block table per
        group when the caller keeps them. On the graph path the hidden states are a view of the graph's output
        buffer: take what is needed before the next replay."""
        if not self.can_run(step):
            raise ValueError("MixedGraphs runs steps with a prefill chunk of at most its largest size")
        t = len(step.token_ids)
        size = self.bucket(t)
        inputs = self._fill(lay_out(step, self.block_size, self.compressions, tables), size)
        captured = self.graphs.get(size)
        if captured is None:
            return self._forward(inputs)[:t], inputs
        captured.graph.replay()
        return captured.output[:t], inputs
