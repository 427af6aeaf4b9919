"""Attention backends as objects, chosen once at startup for each KV cache group (device x spec).

Each backend builds its group's AttentionMetadata for a step (build_metadata) and puts itself in it, and the
model's attention layers call it (DeepSeek-V4's through sink_attention); no kernel wrapper or model looks at
the tensors' device or the ops to decide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backend_base import BackendBase
from ladle.attention.cpu_attention import CpuAttention
from ladle.attention.metadata import AttentionMetadata
from ladle.attention.sink_attention import CompressedEntries, sink_attention_triton
from ladle.kernels.cpu_kernels import KernelUnavailable
from ladle.kernels.cpu_kernels import load as load_cpu_kernels
from ladle.kv_cache.specs import AttentionSpec, KVCacheLayout, paged_group


class TorchAttention(BackendBase):
    """The torch reference (CPU, and the oracle the Triton kernels are tested against): any window."""

    name = "torch"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        from ladle.attention import torch_ref

        return torch_ref.paged_attention(q, k, v, k_cache, v_cache, attn, scale)


class TritonAttention(BackendBase):
    """CUDA: one Triton launch per layer reads the pool through the block tables (no gathered context, no host
    sync; split-KV for small decode batches), full or sliding-window attention."""

    name = "triton"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        from ladle.attention import triton_attention  # imported here, so CPU installs never need triton

        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, attn, scale)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attn: AttentionMetadata) -> None:
        from ladle.attention import triton_attention

        triton_attention.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)

    def sink_attention(self, q: torch.Tensor, pool: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                       window: int, sinks: torch.Tensor, scale: float,
                       entries: CompressedEntries | None) -> torch.Tensor:
        return sink_attention_triton(q, pool, positions, attn, window, sinks, scale, entries)


AttentionBackend = TorchAttention | TritonAttention | CpuAttention


def resolve_backend(device: torch.device, requested: str | None) -> tuple[str, str]:
    """The attention backend's name on this device, and why when it was not requested (vLLM's
    --attention-backend): CUDA runs triton; CPU runs ladle's C decode kernel where it builds, torch where not."""
    if device.type == "cuda":
        if requested not in (None, "triton"):
            raise ValueError(f"attention_backend={requested!r} runs on CPU only; on CUDA use triton (or leave it "
                             "unset)")
        return "triton", "" if requested else "the Triton kernels, on CUDA"
    if requested == "triton":
        raise ValueError("attention_backend='triton' needs CUDA; on CPU use cpu or torch (or leave it unset)")
    if requested == "torch":
        return "torch", ""
    try:
        load_cpu_kernels()
    except KernelUnavailable as e:
        if requested == "cpu":
            raise ValueError(f"attention_backend='cpu' needs ladle's C kernels, which are unavailable: {e}; use "
                             "attention_backend='torch'") from None
        return "torch", f"ladle's C kernels are unavailable here ({e})"
    return "cpu", "" if requested else "decode rows in ladle's C kernel (the KV pool read in place), prefills in torch"


def select_backend(device: torch.device, spec: AttentionSpec, name: str | None = None) -> AttentionBackend:
    """The backend for a group of layers of this spec on this device (name: resolve_backend's choice, resolved
    here when None), or a ValueError saying what is missing."""
    name = name or resolve_backend(device, None)[0]
    if name == "triton":
        backend = TritonAttention()
        if not backend.supports(spec):
            raise ValueError(f"no CUDA attention backend for {spec.describe()} yet; use device cpu")
        return backend
    if name == "cpu" and CpuAttention.supports(spec):
        return CpuAttention(load_cpu_kernels())
    return TorchAttention()


@dataclass(frozen=True)
class AttentionGroup:
    """One paged KV cache group as the runner serves it: what its layers keep, which layers they are, and the
    backend chosen for them at startup. The runner, the input builders and the graphs take these."""

    spec: AttentionSpec
    layers: tuple[int, ...]
    backend: AttentionBackend

    @property
    def window(self) -> int | None:
        return self.spec.sliding_window

    @property
    def compression(self) -> tuple[int, int]:
        return self.spec.compression


def attention_groups(layout: KVCacheLayout, device: torch.device, name: str | None = None
                     ) -> tuple[AttentionGroup, ...]:
    """Each paged group of the layout with its backend (name: resolve_backend's choice)."""
    return tuple(AttentionGroup(g.spec, g.layers, select_backend(device, g.spec, name)) for g in layout.groups)


def reference_group(window: int | None = None, backend: AttentionBackend | None = None) -> AttentionGroup:
    """A full-attention (or sliding-window) group on the given backend, the torch reference by default: the
    input builders' default, and tests'."""
    group = paged_group(window)
    return AttentionGroup(group.spec, group.layers, backend or TorchAttention())
