"""Every attention backend by name (vLLM's backends/registry.py), in the order the selector tries them on a
device when none is named. ladle.config.engine_args.ATTENTION_BACKENDS lists the same names for the CLI (config
sits below attention, so it cannot read them here; a test keeps the two equal)."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ladle.attention.backend import AttentionBackend
from ladle.attention.cpu_attention import CpuAttention
from ladle.attention.torch_backend import TorchAttention
from ladle.attention.triton_backend import TritonAttention

BACKENDS: Mapping[str, type[AttentionBackend]] = MappingProxyType(
    {cls.name: cls for cls in (TritonAttention, CpuAttention, TorchAttention)})


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]
