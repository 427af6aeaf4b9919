"""The CUDA backend: one Triton launch per layer reads the pool through the block tables (no gathered context,
no host sync; split-KV for small decode batches), full or sliding-window attention, and DeepSeek-V4's sink
attention in a kernel of its own. Its kernels are imported where they run, so CPU installs never need triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ladle.attention.backend import AttentionBackend, BackendMetadata, CacheKind
from ladle.attention.metadata import AttentionMetadata
from ladle.attention.sink_attention import CompressedEntries, sink_attention_triton
from ladle.attention.sink_capability import SupportsSinkAttention


@dataclass(frozen=True, kw_only=True)
class TritonAttentionMetadata(BackendMetadata):
    backend: TritonAttention


class TritonAttention(AttentionBackend, SupportsSinkAttention):
    name: ClassVar[str] = "triton"
    description: ClassVar[str] = "the Triton kernels, on CUDA"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    # fp32 with IEEE products (so it can match HF), half types with fp32 accumulation.
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    kinds: ClassVar[frozenset[CacheKind]] = frozenset(CacheKind)
    metadata_cls: ClassVar[type[BackendMetadata]] = TritonAttentionMetadata

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        from ladle.attention import triton_attention

        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, attn, scale)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attn: AttentionMetadata) -> None:
        from ladle.attention import triton_attention

        triton_attention.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)

    def sink_attention(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       window: int, sinks: torch.Tensor, scale: float,
                       entries: CompressedEntries | None) -> torch.Tensor:
        return sink_attention_triton(q, pool, positions, attn, window, sinks, scale, entries)
