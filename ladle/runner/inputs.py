"""Per-step model inputs: a step's layout (ladle.runner.step_layout) put into StepBuffers and described to the
attention backends, one BackendMetadata per KV cache group (slots and block tables differ; positions and
lengths are shared) and one StateMetadata for the state groups. Eager steps and both CUDA-graph classes come
through fill_inputs; the graphs only pad the layout first and name static buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backend import BackendMetadata
from ladle.attention.groups import AttentionGroup, reference_group
from ladle.attention.metadata import CommonAttentionMetadata, StateMetadata
from ladle.runner.step_batch import StepBatch
from ladle.runner.step_buffers import StepBuffers
from ladle.runner.step_layout import StepLayout, lay_out


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_groups: tuple[BackendMetadata | StateMetadata, ...]  # one per paged group, then per state group
    logits_indices: torch.Tensor  # [S] int64: rows of the hidden states whose next token is sampled
    sampled_rows: tuple[int, ...]  # index into the chunk list of each sampled row, in logits order

    @property
    def attn(self) -> BackendMetadata:
        """The metadata of a model with one KV cache group."""
        first = self.attn_groups[0]
        assert isinstance(first, BackendMetadata)  # that one group is paged, and paged groups come first
        return first

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_inputs(
    batch: StepBatch, block_size: int, device: torch.device | str = "cpu",
    block_tables: tuple[torch.Tensor, ...] | None = None, groups: tuple[AttentionGroup, ...] | None = None,
    num_state_groups: int = 0, buffers: StepBuffers | None = None,
) -> StepInputs:
    """block_tables: the step's [requests, >= blocks needed] int32 host table per group, when the caller keeps
    the tables itself (ladle.runner.block_table); otherwise they are built from the block id lists.
    groups: the paged KV cache groups with their backends (one full-attention group on the torch reference if
    None); a compressed group's entries are written by the model, so it gets no slot mapping.
    num_state_groups: the model's state groups, which all get the same StateMetadata (a request has one slot
    index in every state layer). buffers: where the inputs go on the device (a fresh set if None)."""
    buffers = buffers or StepBuffers(torch.device(device))
    groups = groups or (reference_group(),)
    n, num_tokens = len(batch), len(batch.token_ids)
    if not n or min(batch.num_tokens) < 1:
        raise ValueError("a step needs at least one chunk, and every chunk at least one token")
    if num_tokens != sum(batch.num_tokens):
        raise ValueError(f"{num_tokens} token ids for chunks of {sum(batch.num_tokens)} tokens")
    if any(len(t) != len(groups) for t in batch.block_ids):
        raise ValueError(f"every chunk needs a block table for each of the {len(groups)} groups")
    layout = lay_out(batch, block_size, tuple(g.compression for g in groups), block_tables)
    return fill_inputs(layout, buffers, block_size, groups, num_state_groups)


def fill_inputs(layout: StepLayout, buffers: StepBuffers, block_size: int, groups: tuple[AttentionGroup, ...],
                num_state_groups: int = 0, prefix: str = "") -> StepInputs:
    """The layout put into buffers (names under prefix: a graph's static buffers, reserved by
    reserve_inputs), and each group's metadata as its backend builds it."""
    buffers.begin()
    common = CommonAttentionMetadata(
        buffers.put(prefix + "cu_seqlens", layout.cu, torch.int32),
        buffers.put(prefix + "context_lens", layout.context, torch.int32), layout.query_lens,
        tuple(layout.context if isinstance(layout.context, list) else layout.context.tolist()), block_size)
    metadata: list[BackendMetadata | StateMetadata] = [
        g.backend.build_metadata(common, buffers.put(f"{prefix}slots{i}", layout.slots[i], torch.int64),
                                 buffers.put(f"{prefix}tables{i}", layout.tables[i], torch.int32), g.window)
        for i, g in enumerate(groups)]
    if num_state_groups:
        metadata += [_state_metadata(layout, buffers)] * num_state_groups
    inputs = StepInputs(
        input_ids=buffers.put(prefix + "input_ids", layout.token_ids, torch.int64),
        positions=buffers.put(prefix + "positions", layout.positions, torch.int64),
        attn_groups=tuple(metadata),
        logits_indices=buffers.put(prefix + "logits_indices", layout.logits_indices, torch.int64),
        sampled_rows=layout.sampled_rows,
    )
    buffers.end()
    return inputs


def _state_metadata(layout: StepLayout, buffers: StepBuffers) -> StateMetadata:
    """One StateMetadata for every state group: a request has one slot index in every state layer."""
    if layout.state_slots is None or layout.start_pos is None:
        raise ValueError("a padded step cannot carry state groups: CUDA graphs run models without them")
    slots_host = tuple(layout.state_slots)
    if min(slots_host) < 0:
        raise ValueError("a model with per-request state needs every chunk's state slot")
    cu_host = tuple(layout.cu if isinstance(layout.cu, list) else layout.cu.tolist())
    return StateMetadata(buffers.put("state_slots", layout.state_slots, torch.int64), slots_host,
                         buffers.put("state_cu", layout.cu, torch.int64), torch.tensor(cu_host), cu_host,
                         tuple(s > 0 for s in layout.start_pos),
                         None if layout.draft_rows is None else tuple(layout.draft_rows))


def reserve_inputs(buffers: StepBuffers, prefix: str, max_tokens: int, max_requests: int, max_blocks: int,
                   num_groups: int) -> None:
    """Static buffers under prefix for steps of up to these sizes: a CUDA graph captured over fill_inputs'
    views of them reads every later step's values at the same addresses."""
    for name, shape, dtype in (("cu_seqlens", (max_requests + 1,), torch.int32),
                               ("context_lens", (max_requests,), torch.int32),
                               ("input_ids", (max_tokens,), torch.int64), ("positions", (max_tokens,), torch.int64),
                               ("logits_indices", (max_tokens,), torch.int64)):
        buffers.reserve(prefix + name, shape, dtype)
    for g in range(num_groups):
        buffers.reserve(f"{prefix}slots{g}", (max_tokens,), torch.int64)
        buffers.reserve(f"{prefix}tables{g}", (max_requests, max_blocks), torch.int32)
