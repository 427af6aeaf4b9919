"""DeepSeek-V4 attention: shared-KV MQA (one head whose vectors are both key and value) over a sliding window
of the paged cache, plus, in compressed layers, compressed entries: every complete one (HCA) or those the
Lightning Indexer picks (CSA). q comes through a LoRA (wq_a, q_norm, wq_b) and a per-head unweighted RMSNorm;
rope is interleaved and partial (the trailing rope dims), with the "main" table in sliding layers and the
"compress" table in compressed ones. Each head has a learned sink logit, the output's rope slice is rotated
back by the query's position, and the heads leave through a grouped low-rank projection (wo_a, wo_b).

The attention itself runs in the group's backend (ladle.attention.sink_attention): the torch reference,
which loops over the step's requests gathering each one's window from the pool, or one Triton kernel. Only a
backend that declares SupportsSinkAttention runs it: the selector gives this model's groups (one K=V vector per
token) no other at startup, and sink_backend refuses any other a group was built with by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ladle.attention.backend import BackendMetadata
from ladle.attention.metadata import StateMetadata
from ladle.attention.sink_attention import QUERY_BLOCK, CompressedEntries
from ladle.attention.sink_capability import SupportsSinkAttention
from ladle.models.deepseek_v4.compressor import (
    Compressor,
    Dsv4RMSNorm,
    Indexer,
    entry_slots,
    interleaved_rope,
    unweighted_rms_norm,
)
from ladle.models.layers.decoder_layer import RotaryEmbedding
from ladle.quantization.fp8_linear import Fp8Linear

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


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
    entries_meta: BackendMetadata
    index_keys: torch.Tensor | None
    index_meta: BackendMetadata | None
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

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, rope: Any, kv_cache: tuple[torch.Tensor, ...],
                 attn: BackendMetadata) -> None:
        """A sliding layer's K=V vectors at these positions into its window's pool, and nothing else."""
        cos, sin = rope(positions, x.dtype)
        self._write_window(x, cos, sin, kv_cache, attn)

    def _write_window(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, ...], attn: BackendMetadata) -> torch.Tensor:
        """x's K=V vectors [t, D] (key and value alike) into the window's pool; returns the pool as rows."""
        pool = kv_cache[0].view(-1, self.head_dim)
        pool[attn.slot_mapping] = interleaved_rope(self.norm(self.wkv(x)), cos, sin)
        return pool

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Any, kv_cache: tuple[torch.Tensor, ...],
                attn: BackendMetadata, compressed: CompressedCaches | None) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = rope(positions, x.dtype)
        q_residual = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        q = interleaved_rope(q, cos, sin)
        pool = self._write_window(x, cos, sin, kv_cache, attn)
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
                assert c.index_meta is not None  # given wherever the layer has an indexer (asserted above)
                rows = slice(cu[i], cu[i + 1])
                keys = keys_pool[entry_slots(c.index_meta.block_tables[i], 0, idx_counts[i], keys_per_block)]
                picks.append(self.indexer.select(x[rows], q_residual[rows], cos[rows], sin[rows], keys,
                                                 positions[rows], QUERY_BLOCK))
        entries = (None if self.compressor is None
                   else CompressedEntries(entry_pool, entry_rows, picks, self.compressor.rate))
        # The group's backend runs it: the torch reference, or one Triton kernel on CUDA.
        out = sink_backend(attn).sink_attention(q, pool, positions, attn, self.window, self.attn_sink.float(),
                                                self.head_dim**-0.5, entries)
        out = interleaved_rope(out, cos, -sin)  # values carried rope: rotate it back at the query's position
        return self.wo_b(grouped_projection(self.wo_a, out.reshape(t, self.o_groups, -1)).reshape(t, -1))


def sink_backend(attn: BackendMetadata) -> SupportsSinkAttention:
    """The group's backend, as the one that runs DeepSeek-V4's attention, or a TypeError naming it."""
    if not isinstance(attn.backend, SupportsSinkAttention):
        raise TypeError(f"DeepSeek-V4's attention needs a backend that runs sink attention "
                        f"(ladle.attention.sink_capability); the {attn.backend.name!r} backend does not")
    return attn.backend


def grouped_projection(layer: nn.Linear | Fp8Linear, grouped: torch.Tensor) -> torch.Tensor:
    """grouped [T, G, I] through the block-diagonal wo_a (group g's output rows read group g's inputs) ->
    [T, G, R]. FP8 weights are widened a group's rows at a time, never the whole layer."""
    _, groups, _ = grouped.shape
    if isinstance(layer, Fp8Linear):
        r = layer.out_features // groups
        return torch.stack([F.linear(grouped[:, g], layer.dequantized(g * r, (g + 1) * r, grouped.dtype))
                            for g in range(groups)], dim=1)
    return torch.einsum("tgi,gri->tgr", grouped, layer.weight.view(groups, -1, grouped.shape[-1]))
