"""Each paged KV cache group with the backend the selector chose for it at startup: what the runner, the input
builders and the graphs take."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.attention.backend import AttentionBackend
from ladle.attention.selector import select_backend
from ladle.attention.torch_backend import TorchAttention
from ladle.kv_cache.specs import AttentionSpec, KVCacheLayout, paged_group


@dataclass(frozen=True)
class AttentionGroup:
    """One paged KV cache group as the runner serves it: what its layers keep, which layers they are, and its
    backend."""

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
