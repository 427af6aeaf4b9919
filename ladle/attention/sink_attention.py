"""DeepSeek-V4's attention, as the backends run it: shared-KV MQA over a sliding window of the paged pool plus,
in compressed layers, compressed entries (every complete one for HCA, the Lightning Indexer's picks for CSA),
with a learned sink logit per head that takes softmax mass and adds nothing. Keys are values.

sink_attention is the torch reference (CPU, and the oracle): it loops over the step's requests, QUERY_BLOCK
queries at a time. sink_attention_triton gives each token its entries as pool rows and runs
ladle.attention.triton_dsv4's one kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.metadata import AttentionMetadata

# Queries attended at a time: bounds the logits to [heads, block, window + entries].
QUERY_BLOCK = 256


@dataclass
class CompressedEntries:
    """What a compressed layer adds to each request's window."""

    pool: torch.Tensor  # [rows, D]: the entries' K=V vectors
    rows: list[torch.Tensor]  # per request: the pool rows of its entries, in entry order
    picks: list[torch.Tensor | None]  # per request: CSA's [queries, k] picks into rows (-1: none); None: HCA
    rate: int  # tokens per entry: an HCA query at p sees the entries complete at p, (p + 1) // rate


def sink_attention(q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                   window: int, sinks: torch.Tensor, scale: float,
                   entries: CompressedEntries | None) -> torch.Tensor:
    """q [T, H, D]; pool [rows, D] the window's vectors; sinks [H] fp32 -> [T, H, D]. Per request, QUERY_BLOCK
    queries at a time: the window keys (p - W, p] from the pool, then the entries each query sees; softmax
    with each head's sink as one more logit."""
    out = torch.empty_like(q)
    bs = attn.block_size
    sink_logits = sinks[:, None, None]
    row = 0
    for i, (n, end) in enumerate(zip(attn.query_lens, attn.context_lens_host)):
        table = attn.block_tables[i].long()
        mine = None if entries is None else entries.pool[entries.rows[i]]
        for b in range(0, n, QUERY_BLOCK):
            rows = slice(row + b, row + min(n, b + QUERY_BLOCK))
            pos = positions[rows]
            last = end - n + rows.stop - row - 1
            key_pos = torch.arange(max(0, last - (rows.stop - rows.start) - window + 2), last + 1, device=q.device)
            keys = pool[table[key_pos // bs] * bs + key_pos % bs]
            near = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
            logits = [torch.einsum("thd,sd->hts", q[rows], keys).float() * scale]
            logits[0] = logits[0].masked_fill(~near[None], float("-inf"))
            far: torch.Tensor | None = None
            if entries is not None and mine is not None and entries.picks[i] is None:  # HCA: every complete entry
                far = mine[: (last + 1) // entries.rate]
                seen = torch.arange(far.shape[0], device=q.device)[None, :] < ((pos + 1) // entries.rate)[:, None]
                logits.append((torch.einsum("thd,sd->hts", q[rows], far).float() * scale)
                              .masked_fill(~seen[None], float("-inf")))
            elif entries is not None and mine is not None:  # CSA: the entries the indexer picked for each query
                chosen = entries.picks[i][rows.start - row : rows.stop - row]  # type: ignore[index]
                far = mine[chosen.clamp(min=0)]  # [t, k, D]
                logits.append((torch.einsum("thd,tkd->htk", q[rows], far).float() * scale)
                              .masked_fill((chosen < 0)[None], float("-inf")))
            combined = torch.cat((*logits, sink_logits.expand(-1, pos.shape[0], 1)), dim=-1)
            probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1).to(q.dtype)
            o = torch.einsum("hts,sd->thd", probs[..., : keys.shape[0]], keys)
            if far is not None:
                far_probs = probs[..., keys.shape[0] : -1]
                o = o + (torch.einsum("hts,sd->thd", far_probs, far) if far.dim() == 2
                         else torch.einsum("htk,tkd->thd", far_probs, far))
            out[rows] = o
        row += n
    return out


def sink_attention_triton(q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                          window: int, sinks: torch.Tensor, scale: float,
                          entries: CompressedEntries | None) -> torch.Tensor:
    """The same attention in one Triton kernel: each token's compressed entries as pool rows (-1: none)."""
    from ladle.attention.triton_dsv4 import dsv4_attention  # imported here, so CPU installs never need triton

    lens = torch.tensor(attn.query_lens, device=q.device)
    row_request = torch.repeat_interleave(torch.arange(len(attn.query_lens), device=q.device), lens)
    extra = _entry_rows_per_token(q, positions, attn, entries)
    return dsv4_attention(q.contiguous(), pool, attn.block_tables, row_request, positions, window, attn.block_size,
                          pool if entries is None else entries.pool, extra, sinks, scale)


def _entry_rows_per_token(q: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                          entries: CompressedEntries | None) -> torch.Tensor:
    """[T, E]: the entry pool rows each token attends besides its window, -1 for none."""
    if entries is None:
        return torch.full((q.shape[0], 0), -1, dtype=torch.long, device=q.device)
    width = max([r.numel() for r in entries.rows] + [p.shape[1] for p in entries.picks if p is not None], default=0)
    extra = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    row = 0
    for i, rows in enumerate(entries.rows):
        n = attn.query_lens[i]
        chosen = entries.picks[i]
        if chosen is None:  # HCA: the entries complete at each query
            complete = (positions[row : row + n] + 1) // entries.rate
            seen = torch.arange(rows.numel(), device=q.device)[None, :] < complete[:, None]
            extra[row : row + n, : rows.numel()] = torch.where(seen, rows[None, :], -1)
        else:
            extra[row : row + n, : chosen.shape[1]] = torch.where(chosen >= 0, rows[chosen.clamp(min=0)], -1)
        row += n
    return extra
