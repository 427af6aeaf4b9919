"""The capability to run DeepSeek-V4's attention (ladle.attention.sink_attention): a mixin only the backends that
implement it declare, so no other backend carries one model's method. The selector gives layers that keep one
K=V vector per token (CacheKind.SHARED_KV) only such a backend, and DeepSeek-V4's layers check theirs has it."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ladle.attention.metadata import AttentionMetadata
from ladle.attention.sink_attention import CompressedEntries


class SupportsSinkAttention(ABC):
    @abstractmethod
    def sink_attention(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       window: int, sinks: torch.Tensor, scale: float,
                       entries: CompressedEntries | None) -> torch.Tensor:
        """q [T, H, D] over the window's K=V vectors in pool [rows, D] and, in a compressed layer, its entries,
        with a sink logit per head (sinks [H] fp32) -> [T, H, D]."""
