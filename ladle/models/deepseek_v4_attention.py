"""DeepSeek-V4 attention: shared-KV MQA (one head whose vectors are both key and value) over a sliding window
of the paged cache, plus, in compressed layers, compressed entries: every complete one (HCA) or those the
Lightning Indexer picks (CSA). q comes through a LoRA (wq_a, q_norm, wq_b) and a per-head unweighted RMSNorm;
rope is interleaved and partial (the trailing rope dims), with the "main" table in sliding layers and the
"compress" table in compressed ones. Each head has a learned sink logit, the output's rope slice is rotated
back by the query's position, and the heads leave through a grouped low-rank projection (wo_a, wo_b).

This is the reference path: it loops over the step's requests, gathering each one's window from the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ladle.attention.metadata import AttentionMetadata, StateMetadata
from ladle.models.deepseek_v4_compressor import (
    Compressor, Dsv4RMSNorm, Indexer, entry_slots, interleaved_rope, unweighted_rms_norm,
)
from ladle.models.layers import RotaryEmbedding
from ladle.models.ops import ModelOps, TorchOps

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
# Queries attended (and scored by the indexer) at a time: bounds the logits to [heads, block, window + entries].
QUERY_BLOCK = 256


class Dsv4Rope(RotaryEmbedding):
    """One of the config's two rope tables ("main" or "compress"): half-size cos/sin, one per channel pair."""

    def __init__(self, config: Any, kind: str) -> None:
        nn.Module.__init__(self)
        params = config.rope_parameters[kind]
        self.config, self.layer_type = config, kind
        self.rope_type, self.rope_theta = params.get("rope_type", "default"), float(params["rope_theta"])
        self.rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        self.init_buffers()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


@dataclass(frozen=True)
class CompressedCaches:
    """A compressed layer's caches for one step: its entries (and, CSA, the indexer's keys) as one-tensor
    paged layers with their groups' metadata, and its compressors' state slot."""

    entries: torch.Tensor
    entries_meta: AttentionMetadata
    index_keys: torch.Tensor | None
    index_meta: AttentionMetadata | None
    state: tuple[torch.Tensor, ...]
    state_meta: StateMetadata

    @staticmethod
    def view(pool: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
        """The pool tensor [blocks, ...] as rows of one entry, and the entries to a block."""
        per_block = pool[0].numel() // dim
        return pool.view(-1, dim), per_block


class Dsv4Attention(nn.Module):
    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window = config.sliding_window
        self.o_groups = config.o_groups
        eps = config.rms_norm_eps
        self.eps = eps
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = Dsv4RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.norm = Dsv4RMSNorm(self.head_dim, eps)
        group_in = self.num_heads * self.head_dim // config.o_groups
        self.wo_a = nn.Linear(group_in, config.o_groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))
        self.ops: ModelOps = TorchOps()  # TritonOps on CUDA: the attention runs ladle.attention.triton_dsv4
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type != "sliding_attention":
            rate = config.compress_rates[layer_type]
            csa = layer_type == "compressed_sparse_attention"
            self.compressor = Compressor(config, rate, self.head_dim, overlap=csa)
            self.indexer = Indexer(config, rate) if csa else None

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The slot tensors of this layer's compressor(s); none for a sliding layer."""
        shapes = self.compressor.state_shapes() if self.compressor else []
        return shapes + (self.indexer.compressor.state_shapes() if self.indexer else [])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Any, kv_cache: tuple[torch.Tensor, ...],
                attn: AttentionMetadata, compressed: CompressedCaches | None) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = rope(positions, x.dtype)
        q_residual = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        q = interleaved_rope(q, cos, sin)
        kv = interleaved_rope(self.norm(self.wkv(x)), cos, sin)  # [t, D]: key and value alike
        pool = kv_cache[0].view(-1, self.head_dim)
        pool[attn.slot_mapping] = kv
        entry_pool = pool
        entry_rows: list[torch.Tensor] = []  # per request, the pool rows of its entries
        picks: list[torch.Tensor | None] = []
        if self.compressor is not None:
            assert compressed is not None
            c, smeta = compressed, compressed.state_meta
            positions_host = positions.tolist()
            n_main = len(self.compressor.state_shapes())
            entry_pool, per_block = c.view(c.entries, self.head_dim)
            counts = self.compressor(x, c.state[:n_main], smeta, positions_host, rope, entry_pool, c.entries_meta,
                                     per_block)
            if self.indexer is not None:
                assert c.index_keys is not None and c.index_meta is not None
                keys_pool, keys_per_block = c.view(c.index_keys, self.indexer.head_dim)
                idx_counts = self.indexer.compressor(x, c.state[n_main:], smeta, positions_host, rope, keys_pool,
                                                     c.index_meta, keys_per_block)
            cu = smeta.cu_seqlens_host
            for i in range(smeta.num_seqs):
                entry_rows.append(entry_slots(c.entries_meta.block_tables[i], 0, counts[i], per_block))
                if self.indexer is None:
                    picks.append(None)
                    continue
                rows = slice(cu[i], cu[i + 1])
                keys = keys_pool[entry_slots(c.index_meta.block_tables[i], 0, idx_counts[i], keys_per_block)]
                picks.append(self.indexer.select(x[rows], q_residual[rows], cos[rows], sin[rows], keys,
                                                 positions[rows], QUERY_BLOCK))
        if self.ops.name == "triton":
            out = self._attend_triton(q, pool, positions, attn, entry_pool, entry_rows, picks)
        else:
            out = self._attend(q, pool, positions, attn, [entry_pool[r] for r in entry_rows], picks)
        out = interleaved_rope(out, cos, -sin)  # values carried rope: rotate it back at the query's position
        grouped = out.reshape(t, self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])
        return self.wo_b(torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, -1))

    def _attend_triton(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       entry_pool: torch.Tensor, entry_rows: list[torch.Tensor],
                       picks: list[torch.Tensor | None]) -> torch.Tensor:
        """The same attention in one Triton kernel: each token's compressed entries as pool rows (-1: none)."""
        from ladle.attention.triton_dsv4 import dsv4_attention

        lens = torch.tensor(attn.query_lens, device=q.device)
        row_request = torch.repeat_interleave(torch.arange(len(attn.query_lens), device=q.device), lens)
        width = max([r.numel() for r in entry_rows] + [p.shape[1] for p in picks if p is not None], default=0)
        extra = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
        row = 0
        for i, rows in enumerate(entry_rows):
            n = attn.query_lens[i]
            chosen = picks[i]
            if chosen is None:  # HCA: the entries complete at each query
                assert self.compressor is not None
                complete = (positions[row : row + n] + 1) // self.compressor.rate
                seen = torch.arange(rows.numel(), device=q.device)[None, :] < complete[:, None]
                extra[row : row + n, : rows.numel()] = torch.where(seen, rows[None, :], -1)
            else:
                extra[row : row + n, : chosen.shape[1]] = torch.where(chosen >= 0, rows[chosen.clamp(min=0)], -1)
            row += n
        return dsv4_attention(q.contiguous(), pool, attn.block_tables, row_request, positions, self.window,
                              attn.block_size, entry_pool, extra, self.attn_sink.float(), self.head_dim**-0.5)

    def _attend(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                entries: list[torch.Tensor], picks: list[torch.Tensor | None]) -> torch.Tensor:
        """Per request, QUERY_BLOCK queries at a time: the window keys (p - W, p] from the pool, then the
        compressed entries each query sees; softmax with each head's sink as one more logit that takes mass
        but adds nothing. Keys are values (shared KV)."""
        out = torch.empty_like(q)
        bs, scale = attn.block_size, self.head_dim**-0.5
        sinks = self.attn_sink.float()[:, None, None]
        row = 0
        for i, (n, end) in enumerate(zip(attn.query_lens, attn.context_lens_host)):
            table = attn.block_tables[i].long()
            for b in range(0, n, QUERY_BLOCK):
                rows = slice(row + b, row + min(n, b + QUERY_BLOCK))
                pos = positions[rows]
                last = end - n + rows.stop - row - 1
                key_pos = torch.arange(max(0, last - (rows.stop - rows.start) - self.window + 2), last + 1,
                                       device=q.device)
                keys = pool[table[key_pos // bs] * bs + key_pos % bs]
                near = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - self.window)
                logits = [torch.einsum("thd,sd->hts", q[rows], keys).float() * scale]
                logits[0] = logits[0].masked_fill(~near[None], float("-inf"))
                far: torch.Tensor | None = None
                if entries and picks[i] is None:  # HCA: every entry whose group is complete at the query
                    rate = self.compressor.rate
                    far = entries[i][: (last + 1) // rate]
                    seen = torch.arange(far.shape[0], device=q.device)[None, :] < ((pos + 1) // rate)[:, None]
                    logits.append((torch.einsum("thd,sd->hts", q[rows], far).float() * scale)
                                  .masked_fill(~seen[None], float("-inf")))
                elif entries:  # CSA: the entries the indexer picked for each query
                    chosen = picks[i][rows.start - row : rows.stop - row]
                    far = entries[i][chosen.clamp(min=0)]  # [t, k, D]
                    logits.append((torch.einsum("thd,tkd->htk", q[rows], far).float() * scale)
                                  .masked_fill((chosen < 0)[None], float("-inf")))
                combined = torch.cat((*logits, sinks.expand(-1, pos.shape[0], 1)), dim=-1)
                probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1).to(q.dtype)
                o = torch.einsum("hts,sd->thd", probs[..., : keys.shape[0]], keys)
                if far is not None:
                    far_probs = probs[..., keys.shape[0] : -1]
                    o = o + (torch.einsum("hts,sd->thd", far_probs, far) if far.dim() == 2
                             else torch.einsum("htk,tkd->thd", far_probs, far))
                out[rows] = o
            row += n
        return out
