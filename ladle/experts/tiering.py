"""Whether a MoE model's routed experts are tiered, where they live and how many device slots cache them.

Explicit settings are honoured or refused naming the largest that fits; when nothing is set and the experts do
not fit beside room for the KV pool and a step's activations, the tier and the cache size are derived, with the
reason (DESIGN.md invariant 3: derived never overrides explicit)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ladle.config.engine_args import EngineArgs
from ladle.config.sizes import format_bytes

# Of the budget, what a derived tiering leaves for the KV pool, activations and margin: the plan then sizes them
# in it as it does for any model.
ROOM_SHARE = 0.3


@dataclass(frozen=True)
class ExpertInventory:
    """What the loader learns of a MoE model on meta, before any storage exists."""
    resident_bytes: int  # everything but the routed experts (attention, dense layers, shared experts, routers)
    expert_bytes: int  # one expert's tensors, as a slot holds them
    num_layers: int  # MoE layers
    experts_per_layer: int
    top_k: int

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.experts_per_layer

    @property
    def all_expert_bytes(self) -> int:
        return self.total_experts * self.expert_bytes


@dataclass(frozen=True)
class ExpertTiering:
    cache_slots: int
    strategy: str  # offload | cpu | hybrid (ladle.experts.tiered.MissPolicy)
    backing: str  # host | mmap
    prefetch: bool = False  # fetches ahead on a worker thread (ladle.experts.cache)

    def describe(self, inv: ExpertInventory) -> str:
        cached = format_bytes(self.cache_slots * inv.expert_bytes)
        return (f"{self.cache_slots} of {inv.total_experts} experts ({cached}"
                f" of {format_bytes(inv.all_expert_bytes)}) on the device, the rest in {self.backing}")


Put = Callable[..., Any]  # Provenance.put(name, value, derived_reason="")


def resolve_tiering(args: EngineArgs, inv: ExpertInventory | None, budget: int, on_cpu: bool,
                    load_format: str, put: Put) -> ExpertTiering | None:
    """The tiering the engine runs with (None: every expert resident), each setting recorded with its source."""
    given = [n for n in ("moe_cache_size", "moe_cache_fraction", "moe_strategy", "moe_backing", "moe_prefetch")
             if getattr(args, n) is not None]
    if inv is None:
        if given:
            raise ValueError(f"{given[0]} is set, but this model has no routed experts to tier; drop it")
        return None
    if args.moe_strategy == "cpu":
        if args.moe_cache_size is not None or args.moe_cache_fraction is not None:
            raise ValueError("moe_strategy cpu computes every routed expert where it lives and caches none; drop "
                             "moe_cache_size / moe_cache_fraction, or choose offload or hybrid")
        put("moe_strategy", "cpu")
        if args.moe_prefetch:
            raise ValueError("moe_prefetch fetches into the cache, which moe_strategy cpu does not use; drop it")
        return ExpertTiering(0, "cpu", _backing(args, on_cpu, load_format, put))
    room = int(budget * (1 - ROOM_SHARE)) - inv.resident_bytes  # for slots
    largest = max(0, min(inv.total_experts, room // inv.expert_bytes))
    if args.moe_cache_size is not None or args.moe_cache_fraction is not None:
        if args.moe_cache_size is not None:
            slots, name = args.moe_cache_size, "moe_cache_size"
        else:
            assert args.moe_cache_fraction is not None  # one of the two, as just checked
            slots, name = math.ceil(args.moe_cache_fraction * inv.total_experts), "moe_cache_fraction"
        if slots < inv.top_k:
            raise ValueError(f"{name} gives {slots} expert slots, fewer than a token's {inv.top_k} routed experts; "
                             f"give at least {inv.top_k}")
        if slots > inv.total_experts:
            raise ValueError(f"moe_cache_size={slots} exceeds the model's {inv.total_experts} routed experts; drop "
                             "it to keep every expert resident")
        if slots > largest:
            raise ValueError(f"{name} asks for {slots} expert slots ({format_bytes(slots * inv.expert_bytes)}), but "
                             f"beside the resident weights ({format_bytes(inv.resident_bytes)}) and room for the KV "
                             f"pool and activations the budget holds {largest}; give at most {largest}")
        put(name, getattr(args, name))
    elif inv.resident_bytes + inv.all_expert_bytes <= budget * (1 - ROOM_SHARE):
        if given:
            raise ValueError(f"{given[0]} says how tiered experts run, but every expert fits on the device and none "
                             "is tiered; give moe_cache_size or moe_cache_fraction to tier them anyway")
        put("moe_cache_size", "off", f"every routed expert resident: the weights "
            f"({format_bytes(inv.resident_bytes + inv.all_expert_bytes)}) leave room in the budget")
        return None
    else:
        if largest < inv.top_k:
            raise ValueError(f"the resident weights ({format_bytes(inv.resident_bytes)}) leave no room for "
                             f"{inv.top_k} expert slots of {format_bytes(inv.expert_bytes)} in the budget "
                             f"({format_bytes(budget)}); raise memory_budget")
        slots = largest
        put("moe_cache_size", slots, f"the routed experts ({format_bytes(inv.all_expert_bytes)}) do not fit beside "
            f"the resident weights and room for the KV pool and activations: the slots that fit in "
            f"{1 - ROOM_SHARE:.0%} of the budget")
    strategy = put("moe_strategy", args.moe_strategy or "offload",
                   "" if args.moe_strategy else "every miss fetched into a device slot")
    prefetch = put("moe_prefetch", args.moe_prefetch if args.moe_prefetch is not None else not on_cpu,
                   "" if args.moe_prefetch is not None else "on CPU a fetch thread competes with the compute for the "
                   "same cores (measured slower: benchmarks/expert_tiering.py)" if on_cpu else
                   "copies to the device run on its DMA engines beside the compute")
    return ExpertTiering(slots, strategy, _backing(args, on_cpu, load_format, put), prefetch)


def _backing(args: EngineArgs, on_cpu: bool, load_format: str, put: Put) -> str:
    backing = put("moe_backing", args.moe_backing or ("mmap" if on_cpu else "host"), "" if args.moe_backing else
                  "the checkpoint's files: on CPU, host memory is the device's" if on_cpu else "host memory, pinned")
    if backing == "mmap" and load_format == "dummy":
        raise ValueError("moe_backing mmap reads experts from the checkpoint's files, which load_format dummy has "
                         "none of; use moe_backing host")
    return backing
