"""Startup's part in tiered experts (ladle.experts): the setting resolved while the model is on meta, and what
the plan counts once it is loaded."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import Provenance
from ladle.config.sizes import format_bytes
from ladle.experts.backing import HostBacking
from ladle.experts.cache import ExpertCache
from ladle.experts.calibrate import calibrate_hybrid
from ladle.experts.tiering import ExpertInventory, ExpertTiering, resolve_tiering
from ladle.models.interface import CausalLM
from ladle.models.layers.moe import FusedMoE


def tiering_resolver(args: EngineArgs, prov: Provenance, budget: int,
                     device: torch.device) -> Callable[[ExpertInventory | None], ExpertTiering | None]:
    """What load_model calls with the model's experts: the tiering, recorded in the settings table."""
    def resolve(inv: ExpertInventory | None) -> ExpertTiering | None:
        tiering = resolve_tiering(args, inv, budget, device.type == "cpu", args.load_format, prov.put)
        if tiering is not None and inv is not None:
            prov.put("tiered_experts", tiering.describe(inv), "where moe_cache_size and moe_backing put them")
        return tiering
    return resolve


def expert_cache_of(model: CausalLM) -> ExpertCache | None:
    return model.expert_cache


def tiered_bytes(model: CausalLM) -> tuple[int, int]:
    """(bytes in host memory, bytes in the checkpoint files) of the tiered experts."""
    host = files = 0
    for module in model.modules():
        tiered = module.tiered if isinstance(module, FusedMoE) else None
        if tiered is not None:
            if isinstance(tiered.backing, HostBacking):
                host += tiered.backing.nbytes
            else:
                files += tiered.backing.nbytes
    return host, files


def tiered_line(model: CausalLM, device: torch.device) -> tuple[int, str]:
    """Bytes the tier adds to the device's weights (host memory is the device's on CPU), and the plan's line
    on resident vs tiered bytes ('' when nothing is tiered)."""
    cache = expert_cache_of(model)
    if cache is None:
        return 0, ""
    host, files = tiered_bytes(model)
    slots = sum(t.numel() * t.element_size() for t in cache.slot_tensors().values())
    where = (f"{format_bytes(host)} in host memory" + (" (counted in the weights: on CPU it is the device's)"
                                                       if device.type == "cpu" else ", pinned")
             if host else f"{format_bytes(files)} read from the checkpoint's files when needed")
    line = (f"tiered experts: {where}; {cache.num_slots} slots on the device ({format_bytes(slots)}, in the "
            "weights)")
    return (host if device.type == "cpu" else 0), line


def calibrate_tiers(model: nn.Module, prov: Provenance, device: torch.device, dtype: torch.dtype) -> None:
    """moe_strategy hybrid: measure where a miss is cheaper, once, and show the threshold in the settings."""
    layers = [(m, m.tiered) for m in model.modules() if isinstance(m, FusedMoE) and m.tiered is not None]
    if not layers or layers[0][1].policy.strategy != "hybrid":
        return
    first, tiered = layers[0]
    hidden = tiered.cache.slot_tensors()["w2"].shape[1]
    threshold, why = calibrate_hybrid(tiered, first._stacks, hidden, dtype, device, first.swiglu_limit)
    tiered.policy.in_place_max_tokens = threshold
    prov.put("moe_hybrid_in_place_tokens", threshold, why)
