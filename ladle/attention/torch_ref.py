"""Torch reference attention over the paged KV cache, for steps that mix prefill chunks and decodes.

Workspace is bounded by a tile, never by the context length: each request's context is read from the pool
in tiles of at most `context_tile` tokens, and the partial results are merged through their log-sum-exp
(flash-decoding style). A prefill chunk is processed in blocks of `context_tile` queries; each block sees
all keys before it (no mask) and itself (a causal square), so no [Lq, ctx] mask is ever built. Decodes are
batched in groups whose gathered keys stay under `decode_group_tokens`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ladle.attention.metadata import AttentionMetadata

CONTEXT_TILE = 1024  # context tokens read from the pool per attention call
DECODE_GROUP_TOKENS = 16384  # decodes x context tile gathered at once


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kvh, hd] into the pool slots slot_mapping [T] of caches [num_blocks, block_size, kvh, hd]."""
    kvh, hd = k_cache.shape[-2:]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, tables: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Tokens [start, end) of each row's context: [B, max_blocks] block ids -> [B, kvh, end - start, hd]."""
    block_size, kvh, hd = cache.shape[1:]
    first, last = start // block_size, -(-end // block_size)
    ids = tables[:, first:last].to(torch.long)
    # index_select on the flat block ids is several times faster than advanced indexing on CPU.
    ctx = cache.index_select(0, ids.reshape(-1)).view(ids.shape[0], (last - first) * block_size, kvh, hd)
    offset = start - first * block_size
    return ctx[:, offset : offset + end - start].transpose(1, 2).to(dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, D], k/v [B, kvh, Lk, D] -> (output [B, H, Lq, D], log-sum-exp [B, H, Lq] in fp32).

    mask is additive (0 / -inf). Every query row must see at least one key.
    """
    if q.device.type == "cpu":
        # The fused CPU kernel returns the log-sum-exp that tile merging needs (the public SDPA hides it),
        # and maps query head h to kv head h // (H / kvh) itself, as HF's repeat_kv does.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


class _Merger:
    """Running combination of attention over disjoint key sets, weighting each part by exp(its lse - total
    lse); only the running sum is kept, so workspace does not grow with the number of context tiles."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.out is None or self.lse is None:  # set together: both or neither
            self.out, self.lse = out, lse
            return
        total = torch.logaddexp(self.lse, lse)
        self.out = (self.out.float() * torch.exp(self.lse - total)[..., None]
                    + out.float() * torch.exp(lse - total)[..., None]).to(out.dtype)
        self.lse = total

    def result(self) -> torch.Tensor:
        assert self.out is not None, "attention over an empty context"
        return self.out


def _attend_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int,
    scale: float, tile: int,
) -> torch.Tensor:
    """One request's chunk q [1, H, Lq, D] at offset ctx - Lq, flash-style in blocks of `tile` queries: each
    block sees every key before its first query (read in tiles, no mask) and itself causally, so no call
    ever holds more than tile x tile scores and no mask is built."""
    lq = q.shape[2]
    start = ctx - lq
    out = torch.empty_like(q)
    for r0 in range(0, lq, tile):
        r1 = min(r0 + tile, lq)
        block = q[:, :, r0:r1]
        merged = _Merger()
        for s in range(0, start + r0, tile):
            e = min(s + tile, start + r0)
            merged.add(*_attend(block, _gather(k_cache, table, s, e, q.dtype), _gather(v_cache, table, s, e, q.dtype),
                                scale))
        k = _gather(k_cache, table, start + r0, start + r1, q.dtype)
        v = _gather(v_cache, table, start + r0, start + r1, q.dtype)
        merged.add(*_attend(block, k, v, scale, causal=True))
        out[:, :, r0:r1] = merged.result()
    return out


def _decode_groups(decodes: list[tuple[int, int]], tile: int, group_tokens: int) -> list[list[int]]:
    """Split (request index, ctx) decodes, longest first, into groups whose rows x tile width stay within
    group_tokens, so short decodes batch widely and long ones in small groups."""
    ordered = sorted(decodes, key=lambda d: -d[1])
    groups: list[list[int]] = []
    while ordered:
        width = min(ordered[0][1], tile)
        size = max(1, group_tokens // width)
        groups.append([i for i, _ in ordered[:size]])
        ordered = ordered[size:]
    return groups


def _attend_decodes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, cu: list[int],
    group: list[int], scale: float, tile: int, out: torch.Tensor,
) -> None:
    """One query row per request, longest context first; each tile covers the rows whose context reaches it."""
    device = q.device
    ctx = [attn.context_lens_host[i] for i in group]
    rows = torch.tensor([cu[i] for i in group], dtype=torch.long, device=device)
    tables = attn.block_tables[torch.tensor(group, device=attn.block_tables.device)]
    qg = q.index_select(0, rows)[:, :, None, :]  # [B, H, 1, D]
    merged = _Merger()
    for s in range(0, ctx[0], tile):
        live = sum(1 for c in ctx if c > s)  # contexts are sorted descending: a prefix of the rows
        e = min(s + tile, ctx[0])
        k = _gather(k_cache, tables[:live], s, e, q.dtype)
        v = _gather(v_cache, tables[:live], s, e, q.dtype)
        lens = torch.tensor(ctx[:live], device=device)
        mask = torch.zeros(live, 1, 1, e - s, dtype=q.dtype, device=device)
        past_end = torch.arange(s, e, device=device)[None, :] >= lens[:, None]
        mask.masked_fill_(past_end[:, None, None, :], float("-inf"))
        o, lse = _attend(qg[:live], k, v, scale, mask=mask)
        if live < len(group):
            o = torch.cat([o, o.new_zeros(len(group) - live, *o.shape[1:])])
            lse = torch.cat([lse, lse.new_full((len(group) - live, *lse.shape[1:]), float("-inf"))])
        merged.add(o, lse)
    out.index_copy_(0, rows, merged.result()[:, :, 0, :])


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [len(q_pos), len(k_pos)]: a query at p sees keys (p - window, p]."""
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    return torch.zeros(visible.shape, dtype=dtype, device=q_pos.device).masked_fill_(~visible, float("-inf"))


def _attend_prefill_window(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int, scale: float,
    tile: int, window: int,
) -> torch.Tensor:
    """A sliding-window chunk q [1, H, Lq, D] at offset ctx - Lq: each block of `tile` queries reads only the
    keys its window reaches (at most window - 1 + tile of them, whatever the context), in one call."""
    lq = q.shape[2]
    start = ctx - lq
    out = torch.empty_like(q)
    for r0 in range(0, lq, tile):
        r1 = min(r0 + tile, lq)
        lo = max(0, start + r0 - window + 1)
        k = _gather(k_cache, table, lo, start + r1, q.dtype)
        v = _gather(v_cache, table, lo, start + r1, q.dtype)
        q_pos = torch.arange(start + r0, start + r1, device=q.device)
        mask = _window_mask(q_pos, torch.arange(lo, start + r1, device=q.device), window, q.dtype)
        out[:, :, r0:r1] = _attend(q[:, :, r0:r1], k, v, scale, mask=mask[None, None])[0]
    return out


def _attend_decodes_window(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, cu: list[int],
    group: list[int], scale: float, window: int, out: torch.Tensor,
) -> None:
    """One query row per request, each reading the blocks of its own window (at most window / block_size + 1
    of them), gathered at once for the group and masked to (p - window, p]."""
    device, bs = q.device, attn.block_size
    ctx = torch.tensor([attn.context_lens_host[i] for i in group], device=device)
    lo = (ctx - window).clamp_min(0)
    first = lo // bs
    width = int(((ctx + bs - 1) // bs - first).max())
    tables = attn.block_tables[torch.tensor(group, device=attn.block_tables.device)].to(device)
    cols = (first[:, None] + torch.arange(width, device=device)[None, :]).clamp_max(tables.shape[1] - 1)
    blocks = tables.gather(1, cols).clamp_min(0).to(torch.long)
    kvh, hd = k_cache.shape[2:]
    k = k_cache.index_select(0, blocks.reshape(-1)).view(len(group), width * bs, kvh, hd).transpose(1, 2)
    v = v_cache.index_select(0, blocks.reshape(-1)).view(len(group), width * bs, kvh, hd).transpose(1, 2)
    k_pos = first[:, None] * bs + torch.arange(width * bs, device=device)[None, :]
    visible = (k_pos >= lo[:, None]) & (k_pos < ctx[:, None])
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=device).masked_fill_(~visible, float("-inf"))
    rows = torch.tensor([cu[i] for i in group], dtype=torch.long, device=device)
    o, _ = _attend(q.index_select(0, rows)[:, :, None, :], k.to(q.dtype), v.to(q.dtype), scale,
                   mask=mask[:, None, None, :])
    out.index_copy_(0, rows, o[:, :, 0, :])


WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[tuple[int, int]],
                     float, torch.Tensor], None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    context_tile: int = CONTEXT_TILE,
    decode_group_tokens: int = DECODE_GROUP_TOKENS,
    decode: DecodeFn | None = None,
    write: WriteFn = write_kv,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, kvh, D] of this step's tokens -> attention output [T, H, D] in q's dtype.

    The new k/v are written to the cache first, so each request reads its own chunk back with its history.
    decode, when given, computes the one-row requests instead of the torch code below: called as
    decode(q, k_cache, v_cache, attn, cu, [(request index, context length)], scale, out). write stores the new
    k/v, called as write_kv is.
    """
    write(k, v, k_cache, v_cache, attn.slot_mapping)
    out = torch.empty_like(q)
    window = attn.sliding_window
    cu = [0]
    for n in attn.query_lens:
        cu.append(cu[-1] + n)
    decodes: list[tuple[int, int]] = []
    for i, (lq, ctx) in enumerate(zip(attn.query_lens, attn.context_lens_host)):
        if lq == 1:
            decodes.append((i, ctx))
            continue
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]  # [1, H, Lq, D]
        table = attn.block_tables[i : i + 1]
        o = (_attend_prefill(qi, k_cache, v_cache, table, ctx, scale, context_tile) if window is None else
             _attend_prefill_window(qi, k_cache, v_cache, table, ctx, scale, context_tile, window))
        out[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    if not decodes:
        return out
    if decode is not None:
        decode(q, k_cache, v_cache, attn, cu, decodes, scale, out)
    elif window is not None:
        for group in _decode_groups([(i, min(c, window)) for i, c in decodes], window, decode_group_tokens):
            _attend_decodes_window(q, k_cache, v_cache, attn, cu, group, scale, window, out)
    else:
        for group in _decode_groups(decodes, context_tile, decode_group_tokens):
            _attend_decodes(q, k_cache, v_cache, attn, cu, group, scale, context_tile, out)
    return out
