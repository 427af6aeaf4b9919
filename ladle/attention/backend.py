"""What an attention backend is (vLLM's AttentionBackend): a class that declares where it runs and what it serves
(devices, dtypes, cache kinds), and whose objects build each step's metadata for their KV cache group and run the
attention the model's layers call. The metadata a backend builds names it, typed per backend (BackendMetadata).

The selector (ladle.attention.selector) reads the declarations; nothing else asks a backend its name or class.
A capability only some backends have is a mixin those backends declare (ladle.attention.sink_capability).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ladle.attention import torch_ref
from ladle.attention.metadata import AttentionMetadata, CommonAttentionMetadata
from ladle.kv_cache.specs import AttentionSpec

DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}


class CacheKind(enum.Enum):
    """What a group's paged cache holds, as a backend must read it."""

    FULL = "full attention"
    SLIDING_WINDOW = "a sliding window"
    SHARED_KV = "one vector per token as both key and value (DeepSeek-V4's sink attention)"
    COMPRESSED = "entries the model writes itself, several to a page's row (DeepSeek-V4's, QSA's indexer keys)"


def cache_kinds(spec: AttentionSpec) -> frozenset[CacheKind]:
    kinds = {CacheKind.FULL if spec.sliding_window is None else CacheKind.SLIDING_WINDOW}
    if spec.kv_shared:
        kinds.add(CacheKind.SHARED_KV)
    if spec.compression != (1, 1):
        kinds.add(CacheKind.COMPRESSED)
    return frozenset(kinds)


@dataclass(frozen=True, kw_only=True)
class BackendMetadata(AttentionMetadata):
    """A group's metadata as its backend built it: the kernels' inputs and the backend the model's layers call.
    Each backend narrows backend to its own class in a subclass of its own."""

    backend: AttentionBackend


class AttentionBackend(ABC):
    """One way to run paged attention. The class declares what it serves; the selector makes one object per KV
    cache group (create) where the declarations cover the group's spec on the device."""

    name: ClassVar[str]  # what --attention-backend calls it
    description: ClassVar[str]  # why it runs, where the selector picked it unasked
    devices: ClassVar[frozenset[str]]  # torch device types the selector offers it on
    dtypes: ClassVar[frozenset[torch.dtype]]
    kinds: ClassVar[frozenset[CacheKind]]
    # The backend that serves, when this one is named, the groups this one does not support (None: those fail).
    fallback: ClassVar[str | None] = None
    metadata_cls: ClassVar[type[BackendMetadata]]

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run in this process (a kernel that does not build), or None."""
        return None

    @classmethod
    def create(cls) -> AttentionBackend:
        return cls()

    @classmethod
    def lacks(cls, spec: AttentionSpec, device: torch.device) -> list[str]:
        """What it would need to serve layers of this spec on this device; empty where it supports them."""
        missing = []
        if device.type not in cls.devices:
            missing.append(f"{DEVICE_NAMES.get(device.type, device.type)} (it runs on "
                           f"{' or '.join(DEVICE_NAMES[d] for d in sorted(cls.devices))})")
        if spec.dtype not in cls.dtypes:
            missing.append(f"{str(spec.dtype).removeprefix('torch.')} caches")
        missing += [kind.value for kind in sorted(cache_kinds(spec) - cls.kinds, key=lambda k: k.name)]
        return missing

    @classmethod
    def supports(cls, spec: AttentionSpec, device: torch.device) -> bool:
        return not cls.lacks(spec, device)

    def build_metadata(self, common: CommonAttentionMetadata, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, window: int | None) -> BackendMetadata:
        """Its group's metadata for one step; a backend that plans per step keeps its plan there, not in itself."""
        return self.metadata_cls(slot_mapping, common.cu_seqlens_q, common.context_lens, block_tables,
                                 common.query_lens, common.context_lens_host, common.block_size, window, backend=self)

    @abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, attn: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write this step's K/V to the pool, then attend: q [T, H, D] -> [T, H, D]."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 attn: AttentionMetadata) -> None:
        """Only the K/V write of a call, for queries nobody reads (the MTP layer's positions that draft nothing)."""
        torch_ref.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
