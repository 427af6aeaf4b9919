"""The torch reference backend: any dtype, window or cache kind, DeepSeek-V4's sink attention included. The
selector offers it on CPU; on CUDA it is the oracle the Triton kernels are tested against, too slow to serve
(it loops over requests on the host)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ladle.attention import torch_ref
from ladle.attention.backend import AttentionBackend, BackendMetadata, CacheKind
from ladle.attention.metadata import AttentionMetadata
from ladle.attention.sink_attention import CompressedEntries, sink_attention
from ladle.attention.sink_capability import SupportsSinkAttention


@dataclass(frozen=True, kw_only=True)
class TorchAttentionMetadata(BackendMetadata):
    backend: TorchAttention


class TorchAttention(AttentionBackend, SupportsSinkAttention):
    name: ClassVar[str] = "torch"
    description: ClassVar[str] = "the torch reference"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    kinds: ClassVar[frozenset[CacheKind]] = frozenset(CacheKind)
    metadata_cls: ClassVar[type[BackendMetadata]] = TorchAttentionMetadata

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        return torch_ref.paged_attention(q, k, v, k_cache, v_cache, attn, scale)

    def sink_attention(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       window: int, sinks: torch.Tensor, scale: float,
                       entries: CompressedEntries | None) -> torch.Tensor:
        return sink_attention(q, pool, positions, attn, window, sinks, scale, entries)
