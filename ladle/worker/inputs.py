"""Per-step model inputs, built by pure functions and passed to the model explicitly (no globals).

KV pool layout, per layer: a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives, for each KV cache group, in slot
block_ids[group][p // block_size] * block_size + p % block_size. Each group gets its own AttentionMetadata
(slots and block tables differ; positions and lengths are shared).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backends import AttentionBackend, TorchAttention
from ladle.attention.metadata import AttentionMetadata, StateMetadata
from ladle.kv_cache.specs import blocks_held


class ScheduledChunk:
    """One request's share of a step: its new tokens, where they start, and its blocks. (A slotted class, not
    a frozen dataclass: the runner builds one per request per step, and a frozen dataclass costs several times
    more to build.)"""

    __slots__ = ("token_ids", "start_pos", "block_ids", "sample", "state_slot")

    def __init__(self, token_ids: list[int], start_pos: int, block_ids: tuple[list[int], ...] | list[int],
                 sample: bool, state_slot: int = -1) -> None:
        self.token_ids = token_ids  # tokens whose KV this step computes (a prefill chunk, or one decode token)
        self.start_pos = start_pos  # tokens of this request already in the KV cache (num_computed_tokens)
        # The request's block table per KV cache group (a plain list: the one group); each covers
        # start_pos + len(token_ids) tokens, with NULL_BLOCK (-1) where a sliding window gave a block back.
        self.block_ids: tuple[list[int], ...] = block_ids if isinstance(block_ids, tuple) else (list(block_ids),)
        self.sample = sample  # True when this chunk reaches the end of the known tokens, so a token is sampled
        self.state_slot = state_slot  # the request's slot in the state layers (models with StateSpec layers)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_groups: tuple[AttentionMetadata | StateMetadata, ...]  # one per paged group, then per state group
    logits_indices: torch.Tensor  # [S] int64: rows of the hidden states whose next token is sampled
    sampled_rows: tuple[int, ...]  # index into the chunk list of each sampled row, in logits order

    @property
    def attn(self) -> AttentionMetadata:
        """The metadata of a model with one KV cache group."""
        return self.attn_groups[0]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def positions_for(chunks: list[ScheduledChunk]) -> list[int]:
    return [c.start_pos + i for c in chunks for i in range(len(c.token_ids))]


def slot_mapping_for(chunks: list[ScheduledChunk], block_size: int, group: int = 0) -> list[int]:
    slots = []
    for c in chunks:
        blocks = c.block_ids[group]
        for pos in range(c.start_pos, c.start_pos + len(c.token_ids)):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return slots


def cu_seqlens_for(chunks: list[ScheduledChunk]) -> list[int]:
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c.token_ids))
    return cu


def _no_null(blocks: list[int]) -> list[int]:
    return [max(b, 0) for b in blocks] if blocks and min(blocks) < 0 else blocks


def block_table_rows(chunks: list[ScheduledChunk], block_size: int, group: int = 0,
                     compression: tuple[int, int] = (1, 1)) -> list[list[int]]:
    """Each request's blocks that hold its context after this step, padded with 0 to a common width (blocks
    a window gave back read as 0 too: no kernel reads them)."""
    rows = [_no_null(c.block_ids[group][: blocks_held(None, c.start_pos + len(c.token_ids), block_size, 0,
                                                      compression)]) for c in chunks]
    width = max((len(r) for r in rows), default=0)
    return [r + [0] * (width - len(r)) for r in rows]


def build_step_inputs(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device | str = "cpu",
    block_tables: tuple[torch.Tensor, ...] | None = None, windows: tuple[int | None, ...] = (None,),
    backends: tuple[AttentionBackend, ...] | None = None, num_state_groups: int = 0,
    compressions: tuple[tuple[int, int], ...] | None = None,
) -> StepInputs:
    """block_tables: the step's [len(chunks), >= blocks needed] int32 host table per group, when the caller
    keeps the tables itself (ladle.worker.block_table); otherwise they are built from the chunks' block ids.
    windows: each group's sliding window (None: full attention); backends: each group's attention backend,
    chosen at startup (the torch reference when not given). num_state_groups: the model's state groups, which
    all get the same StateMetadata (a request has one slot index in every state layer). compressions: each
    group's (tokens per entry, block scale) (ladle.kv_cache.specs); a compressed group's entries are written by
    the model, so it gets no slot mapping."""
    backends = backends or tuple(TorchAttention() for _ in windows)
    compressions = compressions or tuple((1, 1) for _ in windows)
    if not chunks or any(not c.token_ids for c in chunks):
        raise ValueError("a step needs at least one chunk, and every chunk at least one token")
    for c in chunks:
        end = c.start_pos + len(c.token_ids)
        needed = [blocks_held(None, end, block_size, 0, comp) for comp in compressions]
        if len(c.block_ids) != len(windows) or any(len(b) < n for b, n in zip(c.block_ids, needed)):
            raise ValueError(f"chunk needs {' / '.join(map(str, needed))} blocks for {end} tokens in its "
                             f"{len(windows)} groups, has {[len(b) for b in c.block_ids]}")
    cu = cu_seqlens_for(chunks)
    context = [c.start_pos + len(c.token_ids) for c in chunks]
    sampled_rows = tuple(i for i, c in enumerate(chunks) if c.sample)

    pin = torch.device(device).type == "cuda"

    def as_tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        # From pinned memory the copy is a true async DMA; from pageable memory the host would wait for it.
        host = torch.tensor(values, dtype=dtype)
        return (host.pin_memory() if pin else host).to(device, non_blocking=True)

    cu_t, context_t = as_tensor(cu, torch.int32), as_tensor(context, torch.int32)
    query_lens = tuple(len(c.token_ids) for c in chunks)
    groups = []
    for g, window in enumerate(windows):
        table = (as_tensor(block_table_rows(chunks, block_size, g, compressions[g]), torch.int32)
                 if block_tables is None
                 else (block_tables[g].pin_memory() if pin else block_tables[g]).to(device, non_blocking=True))
        slots = slot_mapping_for(chunks, block_size, g) if compressions[g] == (1, 1) else []
        groups.append(AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64), cu_seqlens_q=cu_t,
            context_lens=context_t, block_tables=table, query_lens=query_lens, context_lens_host=tuple(context),
            block_size=block_size, sliding_window=window, backend=backends[g],
        ))
    if num_state_groups:
        slots = tuple(c.state_slot for c in chunks)
        if min(slots) < 0:
            raise ValueError("a model with per-request state needs every chunk's state slot")
        cu_cpu = torch.tensor(cu, dtype=torch.int64)
        state = StateMetadata(as_tensor(list(slots), torch.int64), slots, as_tensor(cu, torch.int64), cu_cpu,
                              tuple(cu), tuple(c.start_pos > 0 for c in chunks))
        groups += [state] * num_state_groups
    return StepInputs(
        input_ids=as_tensor([t for c in chunks for t in c.token_ids], torch.int64),
        positions=as_tensor(positions_for(chunks), torch.int64),
        attn_groups=tuple(groups),
        logits_indices=as_tensor([cu[i + 1] - 1 for i in sampled_rows], torch.int64),
        sampled_rows=sampled_rows,
    )
