"""Engine settings with provenance: each knows whether the user typed it, it is a default, or it was derived.

Derived never overrides explicit (DESIGN.md invariant 3): the seed report 002 is an engine that silently
replaced an explicit --max-prefill-length and ran out of memory.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

logger = logging.getLogger("ladle")

Source = Literal["explicit", "default", "derived"]
DEFAULT_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's default largest capture size
# vLLM spellings accepted as aliases of ladle's names.
ALIASES = {"long_prefill_token_threshold": "max_prefill_length", "num_gpu_blocks_override": "num_kv_blocks"}


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # default: derived from measured memory (multiple of 64)
    max_prefill_length: int | None = None  # per-request chunk cap; default: max_num_batched_tokens
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: what the memory plan leaves for KV
    kv_cache_memory_bytes: int | str | None = None  # alternative to num_kv_blocks, e.g. "2GiB"
    memory_budget: int | str | None = None  # cap on all ladle may use (weights, KV, activations), e.g. "8GiB"
    gpu_memory_utilization: float = 0.9  # CUDA: share of total device memory (vLLM semantics)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # CUDA: no CUDA graphs, every step eager (vLLM semantics)
    max_cudagraph_capture_size: int | None = None  # largest decode batch replayed from a graph; default 512
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights, for benchmarks: no checkpoint)
    async_scheduling: bool = False  # launch a certain next decode step before reading this one's tokens
    seed: int = 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> tuple["EngineArgs", frozenset[str]]:
        """Build args from user kwargs; returns them with the set of names the user gave explicitly."""
        known = {f.name for f in fields(cls)}
        canon: dict[str, Any] = {}
        for name, value in kwargs.items():
            target = ALIASES.get(name, name)
            if target not in known:
                raise TypeError(f"unknown engine argument {name!r}; known: {sorted(known | set(ALIASES))}")
            if target in canon:
                raise TypeError(f"engine argument {target!r} given twice (once as {name!r})")
            canon[target] = value
        return cls(**canon), frozenset(canon)


@dataclass(frozen=True)
class Setting:
    value: Any
    source: Source
    reason: str = ""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    max_prefill_length: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    seed: int
    enable_prefix_caching: bool = True
    max_cudagraph_capture_size: int = 0  # largest decode batch captured in a CUDA graph; 0 = eager only
    async_scheduling: bool = False
    settings: dict[str, Setting] = field(default_factory=dict)
    plan: Any = None  # the MemoryPlan that sized the memory settings

    def report(self) -> str:
        """The resolved settings with their provenance, then the memory plan."""
        return self.table() + ("\n" + "\n".join(self.plan.lines()) if self.plan is not None else "")

    def table(self) -> str:
        rows = [(k, str(s.value), s.source, s.reason) for k, s in self.settings.items()]
        widths = [max(len(r[i]) for r in rows + [("setting", "value", "source", "")]) for i in range(3)]
        head = f"{'setting':<{widths[0]}}  {'value':<{widths[1]}}  {'source':<{widths[2]}}  reason"
        lines = [head] + [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
        return "\n".join(lines)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in table:
        raise ValueError(f"--dtype {name!r}: choose one of auto, {', '.join(table)}")
    return table[name]


def resolve_cudagraph_size(args: EngineArgs, device: torch.device, prov: Provenance) -> int:
    """Largest decode batch replayed from a CUDA graph; 0 means every step runs eagerly. Graphs exist on CUDA
    alone: on CPU a kernel launch costs nothing that a graph would save."""
    prov.put("enforce_eager", bool(args.enforce_eager))
    name, size = "max_cudagraph_capture_size", args.max_cudagraph_capture_size
    if size is not None:
        positive_int(name, size)
        if device.type != "cuda" or args.enforce_eager:
            why = "enforce_eager disables" if args.enforce_eager else "exist on CUDA only"
            raise ValueError(f"{name}={size} needs CUDA graphs, which {why}; drop {name}")
        return prov.put(name, size)
    if device.type != "cuda" or args.enforce_eager:
        return prov.put(name, 0, "enforce_eager" if args.enforce_eager else f"no CUDA graphs on {device.type}")
    size = min(DEFAULT_CUDAGRAPH_CAPTURE_SIZE, args.max_num_seqs)
    return prov.put(name, size, f"min({DEFAULT_CUDAGRAPH_CAPTURE_SIZE}, max_num_seqs): a decode step has at most "
                                "max_num_seqs rows")


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


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
    """The settings that need no memory measurement, validated; returns the device and dtype."""
    device = resolve_device(args.device)
    prov.put("device", str(device), "" if "device" in prov.explicit else "cuda if available, else cpu")
    dtype = resolve_dtype(args.dtype, device)
    prov.put("dtype", str(dtype).removeprefix("torch."), "" if "dtype" in prov.explicit else f"auto on {device.type}")
    for name in ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks"):
        if getattr(args, name) is not None:
            positive_int(name, getattr(args, name))
    prov.put("max_num_seqs", positive_int("max_num_seqs", args.max_num_seqs))
    prov.put("block_size", positive_int("block_size", args.block_size))
    prov.put("enable_prefix_caching", bool(args.enable_prefix_caching))
    if args.load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {args.load_format!r}: choose one of auto, safetensors, dummy")
    prov.put("load_format", args.load_format)
    prov.put("async_scheduling", bool(args.async_scheduling))
    prov.put("seed", args.seed)
    return device, dtype
