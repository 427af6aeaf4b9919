"""What every attention backend does besides attending: build its metadata for one step and one KV cache group
(build_metadata; a backend that plans per step keeps its plan there, not in itself), write K/V alone, and run
DeepSeek-V4's sink attention (the torch reference unless it has a kernel of its own)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.metadata import AttentionMetadata
from ladle.attention.sink_attention import CompressedEntries, sink_attention


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """What every KV cache group's metadata shares in one step (vLLM's name)."""

    cu_seqlens_q: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    query_lens: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    block_size: int


class BackendBase:
    name = "base"

    def build_metadata(self, common: CommonAttentionMetadata, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, window: int | None) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping, common.cu_seqlens_q, common.context_lens, block_tables,
                                 common.query_lens, common.context_lens_host, common.block_size, window, self)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attn: AttentionMetadata) -> None:
        """Only the K/V write of a call, for queries nobody reads (the MTP layer's positions that draft nothing)."""
        from ladle.attention.torch_ref import write_kv

        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)

    def sink_attention(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       window: int, sinks: torch.Tensor, scale: float,
                       entries: CompressedEntries | None) -> torch.Tensor:
        return sink_attention(q, pool, positions, attn, window, sinks, scale, entries)
