"""Which attention backend serves each KV cache group (vLLM's attention/selector.py): the one the user named
(--attention-backend), or else the first registered backend that runs on the device; each group then gets it
where its declarations cover the group's spec, and an error naming what it lacks where not."""
from __future__ import annotations

import torch

from ladle.attention.backend import DEVICE_NAMES, AttentionBackend
from ladle.attention.registry import BACKENDS, backend_class
from ladle.kv_cache.specs import AttentionSpec


def resolve_backend(device: torch.device, requested: str | None) -> tuple[str, str]:
    """The engine's attention backend on this device, and why when it was not requested."""
    here = [name for name, cls in BACKENDS.items() if device.type in cls.devices]
    if requested is not None:
        cls = backend_class(requested)
        if device.type not in cls.devices:
            needs = " or ".join(DEVICE_NAMES[d] for d in sorted(cls.devices))
            raise ValueError(f"attention_backend={requested!r} needs {needs}; on "
                             f"{DEVICE_NAMES.get(device.type, device.type)} use {' or '.join(here)} (or leave it "
                             "unset)")
        missing = cls.unavailable()
        if missing is not None:
            others = [f"attention_backend={name!r}" for name in here
                      if name != requested and BACKENDS[name].unavailable() is None]
            use = f"; use {' or '.join(others)}" if others else ""
            raise ValueError(f"attention_backend={requested!r} {missing}{use}")
        return requested, ""
    skipped: list[str] = []
    for name in here:
        missing = BACKENDS[name].unavailable()
        if missing is None:
            return name, "; ".join(skipped) or BACKENDS[name].description
        skipped.append(f"the {name} backend {missing}")
    raise ValueError(f"no attention backend runs on {device}: " + ("; ".join(skipped) or "ladle's run on "
                     + " or ".join(sorted({DEVICE_NAMES[d] for cls in BACKENDS.values() for d in cls.devices}))))


def select_backend(device: torch.device, spec: AttentionSpec, name: str | None = None) -> AttentionBackend:
    """The backend for a group of layers of this spec on this device (name: resolve_backend's choice, resolved
    here when None), or a ValueError saying what the named backend lacks."""
    name = name or resolve_backend(device, None)[0]
    cls = backend_class(name)
    lacks = cls.lacks(spec, device)
    if not lacks:
        return cls.create()
    if cls.fallback is not None and backend_class(cls.fallback).supports(spec, device):
        return backend_class(cls.fallback).create()
    raise ValueError(f"attention_backend={name!r} cannot serve layers of {spec.describe()}: it lacks "
                     f"{'; '.join(lacks)}")
