"""Attention backends as objects, chosen once at startup for each KV cache group (device x spec).

The runner puts the group's backend in its AttentionMetadata, and the model's attention layers call it; no
kernel wrapper looks at the tensors' device to decide.
"""
from __future__ import annotations

import torch

from ladle.attention.metadata import AttentionMetadata
from ladle.kv_cache.specs import AttentionSpec


class TorchAttention:
    """The torch reference (CPU, and the oracle the Triton kernels are tested against): any window."""

    name = "torch"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        from ladle.attention import torch_ref

        return torch_ref.paged_attention(q, k, v, k_cache, v_cache, attn, scale)


class TritonAttention:
    """CUDA: one Triton launch per layer reads the pool through the block tables (no gathered context, no host
    sync; split-KV for small decode batches), full or sliding-window attention."""

    name = "triton"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        from ladle.attention import triton_attention  # imported here, so CPU installs never need triton

        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, attn, scale)


AttentionBackend = TorchAttention | TritonAttention


def select_backend(device: torch.device, spec: AttentionSpec) -> AttentionBackend:
    """The backend for a group of layers of this spec on this device, or a ValueError saying what is missing."""
    if device.type != "cuda":
        return TorchAttention()
    backend = TritonAttention()
    if not backend.supports(spec):
        raise ValueError(f"no CUDA attention backend for {spec.describe()} yet; use device cpu")
    return backend
