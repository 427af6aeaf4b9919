"""Engine settings with provenance: each knows whether the user typed it, it is a default, or it was derived.

Derived never overrides explicit (DESIGN.md invariant 3): the seed report 002 is an engine that silently
replaced an explicit --max-prefill-length and ran out of memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch loads only where a device is resolved: validating arguments must be instant
    import torch

    from ladle.config.engine_args import EngineArgs

Source = Literal["explicit", "default", "derived"]
DEFAULT_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's default largest capture size


@dataclass(frozen=True)
class Setting:
    value: Any
    source: Source
    reason: str = ""


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_cudagraph_mode(args: EngineArgs, size: int, prov: Provenance) -> str:
    """Which steps replay graphs, once the largest captured size is settled (0: none, so NONE)."""
    if not size:
        if args.cudagraph_mode is not None:
            raise ValueError(f"cudagraph_mode={args.cudagraph_mode} needs CUDA graphs, and this engine captures "
                             f"none ({prov.settings['max_cudagraph_capture_size'].reason}); drop it")
        return prov.put("cudagraph_mode", "NONE", "no CUDA graphs")
    if args.cudagraph_mode is not None:
        return prov.put("cudagraph_mode", args.cudagraph_mode)
    return prov.put("cudagraph_mode", "FULL", "decode-only steps and steps with a prefill chunk of up to "
                                              "max_cudagraph_capture_size tokens replay graphs")


def resolve_cudagraph_size(args: EngineArgs, device: torch.device, prov: Provenance) -> int:
    """Largest step (in tokens: a decode batch has one a request) replayed from a CUDA graph; 0 means every step
    runs eagerly. Graphs exist on CUDA alone: on CPU a kernel launch costs nothing that a graph would save."""
    prov.put("enforce_eager", bool(args.enforce_eager))
    name, size = "max_cudagraph_capture_size", args.max_cudagraph_capture_size
    if size is not None:
        if device.type != "cuda":
            raise ValueError(f"{name}={size} needs CUDA graphs, which exist on CUDA only; drop {name}")
        return prov.put(name, size)
    if device.type != "cuda" or args.enforce_eager:
        return prov.put(name, 0, "enforce_eager" if args.enforce_eager else f"no CUDA graphs on {device.type}")
    size = min(DEFAULT_CUDAGRAPH_CAPTURE_SIZE, args.max_num_seqs)
    return prov.put(name, size, f"min({DEFAULT_CUDAGRAPH_CAPTURE_SIZE}, max_num_seqs): a decode step has at most "
                                "max_num_seqs rows")


class Provenance:
    """Records every setting with where it came from; derived never overrides explicit."""

    def __init__(self, explicit: frozenset[str]) -> None:
        self.explicit = explicit
        self.settings: dict[str, Setting] = {}

    def put(self, name: str, value: Any, derived_reason: str = "") -> Any:
        if name in self.explicit:
            self.settings[name] = Setting(value, "explicit")
        elif derived_reason:
            self.settings[name] = Setting(value, "derived", derived_reason)
        else:
            self.settings[name] = Setting(value, "default")
        return value


def resolve_basics(args: EngineArgs, prov: Provenance) -> tuple[torch.device, torch.dtype]:
    """The settings that need no memory measurement (validated first); returns the device and dtype."""
    args.validate()
    device = resolve_device(args.device)
    prov.put("device", str(device), "" if "device" in prov.explicit else "cuda if available, else cpu")
    dtype = resolve_dtype(args.dtype, device)
    prov.put("dtype", str(dtype).removeprefix("torch."), "" if "dtype" in prov.explicit else f"auto on {device.type}")
    prov.put("max_num_seqs", args.max_num_seqs)
    prov.put("block_size", args.block_size)
    prov.put("enable_prefix_caching", bool(args.enable_prefix_caching))
    prov.put("load_format", args.load_format)
    prov.put("async_scheduling", bool(args.async_scheduling))
    prov.put("scheduling_policy", args.scheduling_policy)
    prov.put("seed", args.seed)
    return device, dtype
