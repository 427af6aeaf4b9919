"""Torch reference attention over the paged KV cache, for steps that mix prefill chunks and decodes.

Every request in a step attends to its whole context (cached tokens plus this step's chunk), gathered from
the pool through its block table. Memory per request is bounded by Lq x ctx: the step's tokens are never
scored against the concatenated context of the whole step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.worker.inputs import AttentionMetadata

# A decode group may pad its contexts to at most this multiple of their real total, so one long decode
# cannot make a batch of short ones gather (and score) its full length each.
_MAX_DECODE_PADDING = 2


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kvh, hd] into the pool slots slot_mapping [T] of caches [num_blocks, block_size, kvh, hd]."""
    kvh, hd = k_cache.shape[-2:]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, kvh, num_tokens, hd] keys or values, in the query dtype."""
    block_size, kvh, hd = cache.shape[1:]
    num_blocks = -(-num_tokens // block_size)
    ids = block_tables[:, :num_blocks].to(torch.long)
    ctx = cache[ids].reshape(ids.shape[0], num_blocks * block_size, kvh, hd)[:, :num_tokens]
    return ctx.transpose(1, 2).to(dtype)


def _decode_groups(decodes: list[tuple[int, int]]) -> list[list[int]]:
    """Split (request index, ctx) decodes into groups whose padded size stays near their real size."""
    groups: list[list[int]] = []
    longest = total = 0
    for i, ctx in sorted(decodes, key=lambda d: -d[1]):
        if groups and (len(groups[-1]) + 1) * longest <= _MAX_DECODE_PADDING * (total + ctx):
            groups[-1].append(i)
            total += ctx
        else:
            groups.append([i])
            longest = total = ctx
    return groups


def _attend_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    cu: list[int],
    group: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One query row per request: pad the group's contexts to the longest and mask the padding."""
    device = q.device
    rows = torch.tensor([cu[i] for i in group], dtype=torch.long, device=device)
    ctx = torch.tensor([attn.context_lens_host[i] for i in group], device=device)
    longest = int(max(attn.context_lens_host[i] for i in group))
    tables = attn.block_tables[torch.tensor(group, device=attn.block_tables.device)]
    k = _gather_context(k_cache, tables, longest, q.dtype)
    v = _gather_context(v_cache, tables, longest, q.dtype)
    mask = (torch.arange(longest, device=device)[None, :] < ctx[:, None])[:, None, None, :]
    qg = q.index_select(0, rows)[:, :, None, :]  # [B, H, 1, D]
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out.index_copy_(0, rows, o[:, :, 0, :])


def _host_cu(attn: AttentionMetadata) -> list[int]:
    """Row offsets from the host copies of the query lengths, so no device sync is needed."""
    cu = [0]
    for n in attn.query_lens:
        cu.append(cu[-1] + n)
    return cu


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, kvh, D] of this step's tokens -> attention output [T, H, D] in q's dtype.

    The new k/v are written to the cache first, so each request reads its own chunk back with its history.
    """
    write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
    out = torch.empty_like(q)
    cu = _host_cu(attn)
    decodes: list[tuple[int, int]] = []
    for i, (lq, ctx) in enumerate(zip(attn.query_lens, attn.context_lens_host)):
        if lq == 1:
            decodes.append((i, ctx))
            continue
        table = attn.block_tables[i : i + 1]
        ki = _gather_context(k_cache, table, ctx, q.dtype)
        vi = _gather_context(v_cache, table, ctx, q.dtype)
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]  # [1, H, Lq, D]
        if lq == ctx:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at position ctx - lq + j and sees keys up to and including that position.
            keys = torch.arange(ctx, device=q.device)
            queries = torch.arange(ctx - lq, ctx, device=q.device)
            mask = keys[None, :] <= queries[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    for group in _decode_groups(decodes):
        _attend_decodes(q, k_cache, v_cache, attn, cu, group, scale, out)
    return out
