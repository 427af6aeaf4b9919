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
# vLLM spellings accepted as aliases of ladle's names.
ALIASES = {"long_prefill_token_threshold": "max_prefill_length", "num_gpu_blocks_override": "num_kv_blocks"}


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_prefill_length: int | None = None  # per-request chunk cap; default: max_num_batched_tokens
    max_num_seqs: int = 256
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # default: 40% of free memory, at most 1 GiB on CPU
    enable_prefix_caching: bool = True
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
    settings: dict[str, Setting] = field(default_factory=dict)

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


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_config(
    args: EngineArgs,
    explicit: frozenset[str],
    model_max_len: int,
    kv_bytes_per_token: int,
    free_memory: int,
    tokenizer: str | None = None,
) -> EngineConfig:
    """Turn user args into the settings the engine runs with, recording where each came from."""
    settings: dict[str, Setting] = {}

    def put(name: str, value: Any, derived_reason: str = "") -> Any:
        if name in explicit:
            settings[name] = Setting(value, "explicit")
        elif derived_reason:
            settings[name] = Setting(value, "derived", derived_reason)
        else:
            settings[name] = Setting(value, "default")
        return value

    device = resolve_device(args.device)
    put("device", str(device), "" if "device" in explicit else "cuda if available, else cpu")
    dtype = resolve_dtype(args.dtype, device)
    put("dtype", str(dtype).removeprefix("torch."), "" if "dtype" in explicit else f"auto on {device.type}")

    if args.max_model_len is None:
        max_model_len = put("max_model_len", model_max_len, "the model's max_position_embeddings")
    else:
        max_model_len = put("max_model_len", positive_int("max_model_len", args.max_model_len))
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max_len}; "
                f"set max_model_len <= {model_max_len}"
            )
    budget = put("max_num_batched_tokens", positive_int("max_num_batched_tokens", args.max_num_batched_tokens))
    if args.max_prefill_length is None:
        chunk = put("max_prefill_length", budget, "no per-request cap: the step budget bounds each chunk")
    else:
        chunk = put("max_prefill_length", positive_int("max_prefill_length", args.max_prefill_length))
    max_num_seqs = put("max_num_seqs", positive_int("max_num_seqs", args.max_num_seqs))
    block_size = put("block_size", positive_int("block_size", args.block_size))

    blocks_per_seq = -(-max_model_len // block_size)
    if args.num_kv_blocks is None:
        if args.kv_cache_memory_bytes is None:
            cap = 2**30 if device.type == "cpu" else free_memory
            kv_bytes = put("kv_cache_memory_bytes", min(int(free_memory * 0.4), cap),
                           f"40% of {free_memory / 2**30:.1f} GiB free" + (", at most 1 GiB on CPU" if device.type == "cpu" else ""))
        else:
            kv_bytes = put("kv_cache_memory_bytes", positive_int("kv_cache_memory_bytes", args.kv_cache_memory_bytes))
        affordable = kv_bytes // (kv_bytes_per_token * block_size)
        num_blocks = max(blocks_per_seq, min(blocks_per_seq * max_num_seqs, affordable))
        put("num_kv_blocks", num_blocks, f"kv_cache_memory_bytes / {kv_bytes_per_token * block_size} bytes per "
            f"block, at most {max_num_seqs} x {blocks_per_seq}, at least one max_model_len request")
    else:
        num_blocks = put("num_kv_blocks", positive_int("num_kv_blocks", args.num_kv_blocks))
    put("enable_prefix_caching", bool(args.enable_prefix_caching))
    put("seed", args.seed)
    return EngineConfig(
        model=args.model, tokenizer=tokenizer or args.tokenizer or args.model, device=device, dtype=dtype,
        max_model_len=max_model_len, max_num_batched_tokens=budget, max_prefill_length=chunk,
        max_num_seqs=max_num_seqs, block_size=block_size, num_kv_blocks=num_blocks, seed=args.seed,
        enable_prefix_caching=bool(args.enable_prefix_caching), settings=settings,
    )
