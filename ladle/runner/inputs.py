"""Per-step model inputs, built by pure functions and passed to the model explicitly (no globals).

KV pool layout, per layer: a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives, for each KV cache group, in slot
block_ids[group][p // block_size] * block_size + p % block_size. Each group gets its own AttentionMetadata
(slots and block tables differ; positions and lengths are shared).

Positions, slots, offsets and lengths are computed with numpy over the step's columns (StepBatch), never per
token in Python, and reach the device through StepBuffers (pinned staging, non-blocking copies).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ladle.attention.backends import AttentionBackend, TorchAttention
from ladle.attention.metadata import AttentionMetadata, StateMetadata
from ladle.runner.step_buffers import StepBuffers

# A decode-only step of up to this many requests is laid out in Python lists: numpy's fixed cost per call
# outweighs its speed below it (one thread: 32 vs 60 us at 1 decode, 205 vs 175 us at 256).
DECODE_LISTS_MAX = 128


class ScheduledChunk:
    """One request's share of a step: its new tokens, where they start, and its blocks. (A slotted class, not
    a frozen dataclass: callers build one per request per step, and a frozen dataclass costs several times
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


@dataclass
class StepBatch:
    """One step's requests as columns, in step order (the runner fills them in one pass over its requests)."""

    token_ids: list[int]  # every request's new tokens, concatenated
    start_pos: list[int]  # tokens of each request already in the KV cache
    num_tokens: list[int]  # new tokens of each request (>= 1)
    sample: list[bool]  # whether each request's last new token is sampled from
    block_ids: list[tuple[list[int], ...]]  # each request's table per KV cache group
    state_slots: list[int]  # each request's slot in the state layers (-1: none)

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> "StepBatch":
        return cls([t for c in chunks for t in c.token_ids], [c.start_pos for c in chunks],
                   [len(c.token_ids) for c in chunks], [c.sample for c in chunks], [c.block_ids for c in chunks],
                   [c.state_slot for c in chunks])

    def __len__(self) -> int:
        return len(self.start_pos)

    @property
    def is_decode_only(self) -> bool:
        """Every request one sampled token."""
        return len(self.token_ids) == len(self.start_pos) and all(self.sample)


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


def token_layout(start_pos: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cu [B+1], request [T], positions [T]) of a step whose request i has num_tokens[i] new tokens from
    position start_pos[i]: rows cu[i]:cu[i+1] are request i's, row t belongs to request[t] at positions[t]."""
    n = len(num_tokens)
    cu = np.zeros(n + 1, dtype=np.int64)
    num_tokens.cumsum(out=cu[1:])
    if cu[-1] == n:  # one token each (decodes)
        return cu, np.arange(n), start_pos
    request = np.repeat(np.arange(n), num_tokens)
    return cu, request, start_pos[request] + np.arange(cu[-1]) - cu[request]


def slot_mapping(table: np.ndarray, request: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """[T] int64: each new token's pool slot, through its request's row of table [requests, blocks]."""
    block, offset = np.divmod(positions, block_size)
    return table[request, block] * np.int64(block_size) + offset


def blocks_needed(context: np.ndarray, block_size: int, compression: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Blocks each request's table must cover for `context` tokens (ladle.kv_cache.specs.blocks_held, whole)."""
    rate, scale = compression
    if rate > 1:
        return -(-(context // rate) // (block_size * scale))
    return -(-context // block_size)


def table_from_lists(tables: list[list[int]], widths: np.ndarray) -> np.ndarray:
    """[requests, max(widths)] int32 from Python lists, padded with 0 (blocks a window gave back read as 0 too:
    no kernel reads them)."""
    out = np.zeros((len(tables), int(widths.max(initial=0))), dtype=np.int32)
    for i, (blocks, w) in enumerate(zip(tables, widths.tolist())):
        out[i, :w] = blocks[:w]
    np.maximum(out, 0, out=out)
    return out


@dataclass
class _Layout:
    """Where a step's tokens go: per request (cu, context) and per token (positions, slots per group), as
    Python lists for a decode-only step (one token a request: nothing per token to vectorize) or numpy arrays."""

    cu: list[int] | np.ndarray  # [B+1]
    context: list[int] | np.ndarray  # [B]: tokens each request holds after the step
    positions: list[int] | np.ndarray  # [T]
    slots: list[list[int] | np.ndarray]  # [T] per group (empty for compressed groups)
    tables: list[np.ndarray]  # [B, blocks] per group
    logits_indices: list[int] | np.ndarray  # [S]: the last row of each sampled request


def _decode_layout(batch: StepBatch, block_size: int, compressions: tuple[tuple[int, int], ...],
                   block_tables: tuple[torch.Tensor, ...] | None) -> _Layout:
    n, bs = len(batch), block_size
    context = [p + 1 for p in batch.start_pos]
    slots: list[list[int] | np.ndarray] = []
    for g, comp in enumerate(compressions):
        if comp != (1, 1):
            slots.append(np.zeros(0, dtype=np.int64))
            continue
        try:  # the block of each new token, the last one the request's table must hold
            slots.append([t[g][p // bs] * bs + p % bs for t, p in zip(batch.block_ids, batch.start_pos)])
        except IndexError:
            _check_blocks(batch, np.array(context), block_size, compressions)
            raise
    if any(c != (1, 1) for c in compressions):
        _check_blocks(batch, np.array(context), block_size, compressions)
    tables = _tables(batch, np.array(context) if block_tables is None else None, block_size, compressions,
                     block_tables)
    ends = list(range(n)) if all(batch.sample) else [i for i, s in enumerate(batch.sample) if s]
    return _Layout(list(range(n + 1)), context, batch.start_pos, slots, tables, ends)


def _chunk_layout(batch: StepBatch, block_size: int, compressions: tuple[tuple[int, int], ...],
                  block_tables: tuple[torch.Tensor, ...] | None) -> _Layout:
    starts = np.array(batch.start_pos, dtype=np.int64)
    lens = np.array(batch.num_tokens, dtype=np.int64)
    context = starts + lens
    cu, request, positions = token_layout(starts, lens)
    _check_blocks(batch, context, block_size, compressions)
    tables = _tables(batch, context, block_size, compressions, block_tables)
    slots = [slot_mapping(t, request, positions, block_size) if comp == (1, 1) else np.zeros(0, dtype=np.int64)
             for t, comp in zip(tables, compressions)]
    ends = cu[1:][np.array(batch.sample, dtype=bool)] - 1
    return _Layout(cu, context, positions, slots, tables, ends)


def _check_blocks(batch: StepBatch, context: np.ndarray, block_size: int,
                  compressions: tuple[tuple[int, int], ...]) -> None:
    """Every request's table in every group covers its context after the step."""
    n = len(batch)
    needed = [blocks_needed(context, block_size, comp) for comp in compressions]
    for g, need in enumerate(needed):
        have = np.fromiter((len(t[g]) for t in batch.block_ids), dtype=np.int64, count=n)
        if (have < need).any():
            i = int(np.argmax(have < need))
            raise ValueError(f"chunk needs {' / '.join(str(int(x[i])) for x in needed)} blocks for "
                             f"{int(context[i])} tokens in its {len(compressions)} groups, has "
                             f"{[len(t) for t in batch.block_ids[i]]}")


def _tables(batch: StepBatch, context: np.ndarray | None, block_size: int, compressions: tuple[tuple[int, int], ...],
            block_tables: tuple[torch.Tensor, ...] | None) -> list[np.ndarray]:
    """Each group's [requests, blocks] table: the kept ones, or built from the lists (context: their widths)."""
    if block_tables is not None:
        return [t.numpy() for t in block_tables]
    assert context is not None
    return [table_from_lists([t[g] for t in batch.block_ids], blocks_needed(context, block_size, comp))
            for g, comp in enumerate(compressions)]


def build_step_inputs(
    batch: StepBatch | list[ScheduledChunk], block_size: int, device: torch.device | str = "cpu",
    block_tables: tuple[torch.Tensor, ...] | None = None, windows: tuple[int | None, ...] = (None,),
    backends: tuple[AttentionBackend, ...] | None = None, num_state_groups: int = 0,
    compressions: tuple[tuple[int, int], ...] | None = None, buffers: StepBuffers | None = None,
) -> StepInputs:
    """block_tables: the step's [requests, >= blocks needed] int32 host table per group, when the caller keeps
    the tables itself (ladle.runner.block_table); otherwise they are built from the block id lists.
    windows: each group's sliding window (None: full attention); backends: each group's attention backend,
    chosen at startup (the torch reference when not given). num_state_groups: the model's state groups, which
    all get the same StateMetadata (a request has one slot index in every state layer). compressions: each
    group's (tokens per entry, block scale) (ladle.kv_cache.specs); a compressed group's entries are written by
    the model, so it gets no slot mapping. buffers: where the inputs go on the device (a fresh set if None)."""
    if not isinstance(batch, StepBatch):
        batch = StepBatch.of(batch)
    buffers = buffers or StepBuffers(torch.device(device))
    backends = backends or tuple(TorchAttention() for _ in windows)
    compressions = compressions or tuple((1, 1) for _ in windows)
    n, num_tokens = len(batch), len(batch.token_ids)
    if not n or min(batch.num_tokens) < 1:
        raise ValueError("a step needs at least one chunk, and every chunk at least one token")
    if num_tokens != sum(batch.num_tokens):
        raise ValueError(f"{num_tokens} token ids for chunks of {sum(batch.num_tokens)} tokens")
    if any(len(t) != len(windows) for t in batch.block_ids):
        raise ValueError(f"every chunk needs a block table for each of the {len(windows)} groups")
    layout = (_decode_layout if num_tokens == n and n <= DECODE_LISTS_MAX else _chunk_layout)(
        batch, block_size, compressions, block_tables)

    buffers.begin()
    cu_t = buffers.put("cu_seqlens", layout.cu, torch.int32)
    context_t = buffers.put("context_lens", layout.context, torch.int32)
    query_lens = tuple(batch.num_tokens)
    context_host = tuple(layout.context if isinstance(layout.context, list) else layout.context.tolist())
    groups: list[AttentionMetadata | StateMetadata] = []
    for g, window in enumerate(windows):
        groups.append(AttentionMetadata(
            slot_mapping=buffers.put(f"slots{g}", layout.slots[g], torch.int64), cu_seqlens_q=cu_t,
            context_lens=context_t, block_tables=buffers.put(f"tables{g}", layout.tables[g], torch.int32),
            query_lens=query_lens, context_lens_host=context_host, block_size=block_size, sliding_window=window,
            backend=backends[g],
        ))
    if num_state_groups:
        slots_host = tuple(batch.state_slots)
        if min(slots_host) < 0:
            raise ValueError("a model with per-request state needs every chunk's state slot")
        cu_host = tuple(layout.cu if isinstance(layout.cu, list) else layout.cu.tolist())
        state = StateMetadata(buffers.put("state_slots", batch.state_slots, torch.int64), slots_host,
                              buffers.put("state_cu", layout.cu, torch.int64), torch.tensor(cu_host), cu_host,
                              tuple(s > 0 for s in batch.start_pos))
        groups += [state] * num_state_groups
    inputs = StepInputs(
        input_ids=buffers.put("input_ids", batch.token_ids, torch.int64),
        positions=buffers.put("positions", layout.positions, torch.int64),
        attn_groups=tuple(groups),
        logits_indices=buffers.put("logits_indices", layout.logits_indices, torch.int64),
        sampled_rows=tuple(i for i, s in enumerate(batch.sample) if s),
    )
    buffers.end()
    return inputs
