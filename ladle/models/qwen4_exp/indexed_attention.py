"""QSA indexed attention (HF's Qwen4ExpTextAttention with its Qwen4ExpTextQSAIndexer): Qwen3.5's gated attention
(q/k norm, partial rope, a sigmoid gate on the output) where each query attends only to the tokens its indexer
selects.

The indexer projects each token to indexer_n_heads query heads and one raw key. A query at position p sees
(p + 1) // R complete blocks of R = indexer_compress_ratio tokens; each block's key is the fp32 mean of its raw
keys, normed (k_layernorm) and roped at the block's first position. The query scores every such block (the
sum over its heads of relu(q . key), / sqrt(indexer_head_dim)) and attends to the tokens of its top
indexer_budget // R blocks plus the incomplete tail (the tokens after the last complete block, itself among
them).

Caches: K and V paged as for full attention; the raw indexer keys paged per token too, in a KV cache group of their
own (indexer_key_spec) whose pages hold as many tokens' keys as fit: each key's first half in the K page, its
second half in the V page, so the pool counts their real bytes (an eighth of a K/V row on the Flash-Next shape)
rather than a whole row. The layer writes them itself, at the slots its group's block table gives. The block
keys are recomputed from the paged raw keys when a step needs them, so a block completed across prefill chunks
(or a prefix-cache hit) gives the same keys as HF's whole-prompt pass. This is the torch reference: each request's
context is gathered whole.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.kv_cache.specs import AttentionSpec
from ladle.models.layers.ops import apply_rotary
from ladle.models.qwen3_5.model import GatedAttention
from ladle.models.qwen4_exp.norms import GroupedRMSNorm


def indexer_key_spec(config: Any, dtype: torch.dtype) -> AttentionSpec:
    """The indexer keys' group: a K/V page row of the attention (num_key_value_heads x head_dim values) split into
    as many entries as still hold half a key, so a page holds that many times block_size tokens' keys."""
    row = config.num_key_value_heads * config.head_dim
    half = -(-config.indexer_head_dim // 2)
    scale = max(s for s in range(1, row // half + 1) if row % s == 0 and row // s >= half)
    return AttentionSpec(1, row // scale, dtype, block_scale=scale,
                         label=f"QSA indexer keys, {config.indexer_head_dim} a token as halves in K and V")


class QsaIndexer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.heads, self.dim = config.indexer_n_heads, config.indexer_head_dim
        self.ratio = config.indexer_compress_ratio
        self.top_blocks = config.indexer_budget // self.ratio
        self.index_qk_proj = nn.Linear(config.hidden_size, (self.heads + 1) * self.dim, bias=False)
        self.q_layernorm = GroupedRMSNorm(self.dim, config.rms_norm_eps)
        self.k_layernorm = GroupedRMSNorm(self.dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (normed, roped queries [T, heads, dim], raw keys [T, dim])."""
        q, k = self.index_qk_proj(x).split((self.heads * self.dim, self.dim), dim=-1)
        return partial_rope(self.q_layernorm(q.view(-1, self.heads, self.dim)), cos, sin), k

    def visible(self, q: torch.Tensor, positions: torch.Tensor, raw_keys: torch.Tensor, rope: Any) -> torch.Tensor:
        """One request: queries q [L, heads, dim] at positions [L] and the raw keys of its context [C, dim] ->
        which context tokens each query attends to, [L, C] bool. rope: the model's rotary embedding."""
        c, r = raw_keys.shape[0], self.ratio
        token = torch.arange(c, device=q.device)
        causal = token[None, :] <= positions[:, None]
        complete = (positions + 1) // r  # each query's complete blocks
        n = c // r
        if n == 0 or int(complete.max()) <= self.top_blocks:
            return causal  # no query has more blocks than it may keep
        pooled = raw_keys[: n * r].view(n, r, self.dim).float().mean(dim=1).to(raw_keys.dtype)
        block = torch.arange(n, device=q.device)
        cos, sin = rope(block * r, q.dtype)  # each block roped at its first position
        keys = partial_rope(self.k_layernorm(pooled)[:, None], cos, sin)[:, 0]
        seen = block[None, :] < complete[:, None]
        picked = torch.zeros(q.shape[0], n + 1, dtype=torch.bool, device=q.device)
        picked[:, :n] = seen
        # Every query against every complete block at once (HF scores one query's blocks at a time: the same
        # products).
        scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)).transpose(-1, -2))
        scores = scores.sum(-1) / math.sqrt(self.dim)
        for j in (complete > self.top_blocks).nonzero().flatten().tolist():
            # relu zeroes many scores, and torch.topk breaks such ties by the vector it is given: each query
            # ranks exactly its own complete blocks, as HF does.
            top = scores[j, : int(complete[j])].topk(self.top_blocks, dim=0).indices
            picked[j, :n] = False
            picked[j, top] = True
        in_block = torch.clamp(token // r, max=n).expand(q.shape[0], -1)
        tail = token[None, :] >= (complete * r)[:, None]
        return causal & (picked.gather(1, in_block) | tail)


class IndexedAttention(GatedAttention):
    """Names as HF's checkpoint has them: `self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `indexer.*`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.indexer = QsaIndexer(config)
        if self.indexer.dim > self.num_kv_heads * self.head_dim:
            raise ValueError(f"indexer_head_dim {self.indexer.dim} is wider than num_key_value_heads x head_dim "
                             f"{self.num_kv_heads * self.head_dim}: a key's halves must fit a K and a V page row")
        self.entry = indexer_key_spec(config, torch.float32).head_dim  # values of a key half's entry
        self.key_half = -(-self.indexer.dim // 2)

    # It takes more than Qwen3.5's attention (positions, the indexer's key cache, the rope for block keys): a
    # different call, on purpose, so no caller can run it as plain causal attention.
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,  # type: ignore[override]
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], index_cache: tuple[torch.Tensor, ...],
                attn: BackendMetadata, index_meta: BackendMetadata, rope: Any) -> torch.Tensor:
        """index_cache, index_meta: the indexer keys' pages and their group's metadata; rope: the model's rotary
        embedding, for the block keys' positions."""
        t = x.shape[0]
        q_gate, k, v = self._qkv(x, cos, sin)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rope(self.q_norm(q), cos, sin)
        iq, raw = self.indexer.project(x, cos, sin)
        attn.backend.write_kv(k, v, kv_cache[0], kv_cache[1], attn)
        pages = [p.view(p.shape[0], -1, self.entry) for p in index_cache[:2]]  # [blocks, entries, entry]
        per_block = pages[0].shape[1]
        cu = attn.cu_seqlens_q.tolist()
        request = torch.repeat_interleave(torch.arange(len(cu) - 1, device=x.device), attn.cu_seqlens_q.diff())
        slots = index_meta.block_tables[request, positions // per_block].to(torch.long) * per_block + (
            positions % per_block)
        halves = (raw[:, : self.key_half], raw[:, self.key_half:])
        for page, half in zip(pages, halves):
            page.view(-1, self.entry)[slots, : half.shape[1]] = half.to(page.dtype)
        out = torch.empty(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for i, c in enumerate(attn.context_lens_host):
            rows = slice(cu[i], cu[i + 1])
            if cu[i + 1] == cu[i]:
                continue
            ids = attn.block_tables[i, : -(-c // kv_cache[0].shape[1])].to(torch.long)
            keys, values = (cache.index_select(0, ids).view(-1, self.num_kv_heads, self.head_dim)[:c]
                            for cache in kv_cache[:2])
            key_ids = index_meta.block_tables[i, : -(-c // per_block)].to(torch.long)
            raw_keys = torch.cat([page.index_select(0, key_ids).view(-1, self.entry)[:c, : half.shape[1]]
                                  for page, half in zip(pages, halves)], dim=-1)
            mask = self.indexer.visible(iq[rows], positions[rows], raw_keys, rope)
            out[rows] = _masked_attention(q[rows], keys, values, mask, self.scale)
        o = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first cos.shape[-1] dims of each head (HF's apply_rotary_pos_emb with partial rotary)."""
    rot = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


QUERY_TILE = 256  # queries scored at once: their [heads, rows, context] scores are a long step's largest tensor


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [L, H, D], k/v [C, kvh, D], mask [L, C] -> [L, H, D]; query head h reads kv head h // (H / kvh)."""
    length, heads, dim = q.shape
    kvh = k.shape[1]
    keys, values = k.float(), v.float()
    out = torch.empty_like(q)
    for start in range(0, length, QUERY_TILE):
        rows = slice(start, start + QUERY_TILE)
        grouped = q[rows].float().view(-1, kvh, heads // kvh, dim)
        scores = torch.einsum("lkgd,ckd->kglc", grouped, keys) * scale
        probs = torch.softmax(scores.masked_fill_(~mask[rows], float("-inf")), dim=-1)
        out[rows] = torch.einsum("kglc,ckd->lkgd", probs, values).reshape(-1, heads, dim).to(q.dtype)
    return out
