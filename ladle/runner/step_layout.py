"""Where one step's tokens go, on the host: positions, pool slots and block tables per KV cache group,
per-request offsets and lengths, the rows to sample. The one layout every path fills into StepBuffers: eager
steps as they are, CUDA-graph steps padded to a captured size (pad_decodes, pad_tokens).

KV pool layout, per layer: a (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim].
A token at position p of a request lives, for each KV cache group, in slot
block_ids[group][p // block_size] * block_size + p % block_size. Positions, slots, offsets and lengths are
computed with numpy over the step's columns (StepBatch), never per token in Python.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ladle.runner.step_batch import StepBatch

# A decode-only step of up to this many requests is laid out in Python lists: numpy's fixed cost per call
# outweighs its speed below it (one thread: 32 vs 60 us at 1 decode, 205 vs 175 us at 256).
DECODE_LISTS_MAX = 128

Column = list[int] | np.ndarray


@dataclass
class StepLayout:
    token_ids: Column  # [T]
    positions: Column  # [T]
    cu: Column  # [S+1]: request i's tokens are rows cu[i]:cu[i+1]
    context: Column  # [S]: tokens each request holds after the step
    query_lens: tuple[int, ...]  # [S], on the host for backends that loop over requests
    slots: list[Column]  # [T] per group (empty for compressed groups, whose entries the model writes)
    tables: list[np.ndarray]  # [S, blocks] per group
    logits_indices: Column  # [N]: the last row of each sampled request
    sampled_rows: tuple[int, ...]  # [N]: which request each logits row is
    start_pos: list[int] | None  # [S] for state metadata; None once padded (graphs hold no state groups)
    state_slots: list[int] | None
    draft_rows: list[tuple[int, ...]] | None = None  # StepBatch.draft_rows, for state metadata

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


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
    if compression != (1, 1):
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


def lay_out(batch: StepBatch, block_size: int, compressions: tuple[tuple[int, int], ...],
            block_tables: tuple[torch.Tensor, ...] | None) -> StepLayout:
    """The step as it is. block_tables: its [requests, >= blocks needed] host table per group when the caller
    keeps them (ladle.runner.block_table); otherwise built from the block id lists."""
    n = len(batch)
    if len(batch.token_ids) == n and n <= DECODE_LISTS_MAX:
        return _decode_layout(batch, block_size, compressions, block_tables)
    return _chunk_layout(batch, block_size, compressions, block_tables)


def _decode_layout(batch: StepBatch, block_size: int, compressions: tuple[tuple[int, int], ...],
                   block_tables: tuple[torch.Tensor, ...] | None) -> StepLayout:
    n, bs = len(batch), block_size
    context = [p + 1 for p in batch.start_pos]
    slots: list[Column] = []
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
    sampled = tuple(range(n)) if all(batch.sample) else tuple(i for i, s in enumerate(batch.sample) if s)
    return StepLayout(batch.token_ids, batch.start_pos, list(range(n + 1)), context, tuple(batch.num_tokens), slots,
                      tables, list(sampled), sampled, batch.start_pos, batch.state_slots)


def _chunk_layout(batch: StepBatch, block_size: int, compressions: tuple[tuple[int, int], ...],
                  block_tables: tuple[torch.Tensor, ...] | None) -> StepLayout:
    starts = np.array(batch.start_pos, dtype=np.int64)
    lens = np.array(batch.num_tokens, dtype=np.int64)
    context = starts + lens
    cu, request, positions = token_layout(starts, lens)
    _check_blocks(batch, context, block_size, compressions)
    tables = _tables(batch, context, block_size, compressions, block_tables)
    slots: list[Column] = [slot_mapping(t, request, positions, block_size) if comp == (1, 1)
                           else np.zeros(0, dtype=np.int64)
                           for t, comp in zip(tables, compressions)]
    logits, sampled = _sampled(cu, np.array(batch.sample, dtype=bool), batch.num_drafts)
    return StepLayout(batch.token_ids, positions, cu, context, tuple(batch.num_tokens), slots, tables,
                      logits, sampled, batch.start_pos, batch.state_slots, batch.draft_rows)


def _sampled(cu: np.ndarray, sample: np.ndarray, num_drafts: list[int] | None) -> tuple[np.ndarray, tuple[int, ...]]:
    """(rows of the hidden states to sample, the request of each): a sampling request's last row, or with
    drafts its last 1 + drafts rows (each draft is verified against the sample at its own position)."""
    last = cu[1:] - 1
    if num_drafts is None:
        return last[sample], tuple(np.flatnonzero(sample).tolist())
    counts = np.where(sample, np.array(num_drafts, dtype=np.int64) + 1, 0)
    request = np.repeat(np.arange(len(counts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each logits row's request's first row among them
    return last[request] - (counts[request] - 1) + (np.arange(len(request)) - first), tuple(request.tolist())


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


def empty_layout(num_groups: int) -> StepLayout:
    """A step of no requests: what a graph is captured over once padded (its padding writes and reads no KV)."""
    none = np.zeros(0, dtype=np.int64)
    return StepLayout(none, none, np.zeros(1, dtype=np.int64), none, (), [none] * num_groups,
                      [np.zeros((0, 1), dtype=np.int32)] * num_groups, none, (), None, None)


def pad_decodes(layout: StepLayout, rows: int) -> StepLayout:
    """A decode-only step padded to `rows` one-token requests: each padding row has token 0 at position 0,
    slot -1 (its KV write is skipped), context 0 (attention reads nothing for it) and a table row of zeros."""
    n = len(layout.query_lens)
    pad = rows - n
    return StepLayout(
        _extend(layout.token_ids, pad, 0), _extend(layout.positions, pad, 0), np.arange(rows + 1),
        _extend(layout.context, pad, 0), layout.query_lens + (1,) * pad,
        [_extend(s, pad, -1) if len(s) else s for s in layout.slots],
        [_pad_rows(t, rows, t.shape[1]) for t in layout.tables], layout.logits_indices, layout.sampled_rows,
        None, None)


def pad_tokens(layout: StepLayout, tokens: int, requests: int, block_size: int) -> StepLayout:
    """A step padded to `tokens` tokens and `requests` request rows: the tokens - T padding tokens form one more
    request at positions 0.. with slots -1 (its KV is never written) and a table of block 0 (which it reads,
    and nobody uses what it computes), so every row computed is finite; the requests after it have none."""
    n, t = len(layout.query_lens), layout.num_tokens
    pad = tokens - t
    cu = np.full(requests + 1, tokens, dtype=np.int64)
    cu[: n + 1] = layout.cu
    context = np.zeros(requests, dtype=np.int64)
    context[:n] = layout.context
    context[n] = pad  # (0 when the step fills the size: the padding request then has no tokens either)
    width = max(max((tb.shape[1] for tb in layout.tables), default=1), -(-pad // block_size), 1)
    positions = np.empty(tokens, dtype=np.int64)
    positions[:t] = layout.positions
    positions[t:] = np.arange(pad)
    return StepLayout(
        _extend(layout.token_ids, pad, 0), positions, cu, context, tuple(np.diff(cu).tolist()),
        [_extend(s, pad, -1) if len(s) else s for s in layout.slots],
        [_pad_rows(tb, requests, width) for tb in layout.tables], layout.logits_indices, layout.sampled_rows,
        None, None)


def _extend(values: Column, pad: int, fill: int) -> np.ndarray:
    out = np.full(len(values) + pad, fill, dtype=np.int64)
    out[: len(values)] = values
    return out


def _pad_rows(table: np.ndarray, rows: int, width: int) -> np.ndarray:
    out = np.zeros((rows, max(width, table.shape[1], 1)), dtype=np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    return out
