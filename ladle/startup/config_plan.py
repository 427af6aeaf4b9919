"""A memory plan from a model's config alone, for a device this machine need not have: the model built on the
meta device (no storage, however large the model), its weights counted where the settings put them (routed
experts tiered, PLE tables in host memory, as startup would resolve them), its KV layout from its cache specs,
and the plan made by the same planner the engine runs.

A step's activation peak needs a real forward, so it is given (ActivationModel): profiled on a model of the same
widths and fewer layers and experts (benchmarks/qwen4_flash_next_plan.py), whose activations are those of one
layer at a time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ladle.config.engine_args import EngineArgs
from ladle.config.provenance import Provenance
from ladle.config.sizes import format_bytes
from ladle.experts.tiering import ExpertTiering, resolve_tiering
from ladle.kv_cache.specs import KVCacheLayout
from ladle.models.loading.expert_tiering import expert_inventory
from ladle.models.registry import model_class_for
from ladle.runner.penalty_counts import PENALTY_BYTES_PER_TOKEN
from ladle.startup.checkpoints import resolve_checkpoints
from ladle.startup.planner import MemoryPlan, PlanInputs, plan_memory
from ladle.startup.ple_tables import meta_bytes, place_tables
from ladle.startup.profiling import ActivationModel


@dataclass(frozen=True)
class ConfigPlan:
    plan: MemoryPlan
    layout: KVCacheLayout
    settings: Provenance
    parameters: int  # all of the model's, counted on meta

    def report(self) -> str:
        rows = [(name, str(s.value), s.source, s.reason) for name, s in self.settings.settings.items()]
        # A long value (the tiered experts' line) overflows its column rather than widening every row.
        widths = [max(len(r[0]) for r in rows), min(12, max(len(r[1]) for r in rows)), 7]
        table = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip() for a, b, c, d in rows]
        return "\n".join([*table, *self.plan.lines(), *self.layout.lines()])


def plan_from_config(config: Any, activation: ActivationModel, budget: int, args: EngineArgs,
                     explicit: frozenset[str] = frozenset(), dtype: torch.dtype = torch.bfloat16,
                     device_type: str = "cuda") -> ConfigPlan:
    """The plan for config at `budget` bytes of a `device_type` device in dtype, with args' settings (those in
    explicit as typed, the others derived as startup derives them)."""
    prov = Provenance(explicit)
    on_cpu = device_type == "cpu"
    why = "explicit --memory-budget" if "memory_budget" in explicit else "given to the plan"
    prov.put("memory_budget", format_bytes(budget), "" if "memory_budget" in explicit else why)
    prov.put("dtype", str(dtype).removeprefix("torch."))
    prov.put("max_num_seqs", args.max_num_seqs)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    parameters = sum(p.numel() for p in model.parameters())
    inventory = expert_inventory(model, config, dtype)
    everything = (inventory.resident_bytes + inventory.all_expert_bytes if inventory is not None else
                  meta_bytes(model, dtype))
    tables = place_tables(model, args, budget, on_cpu, dtype, prov.put, everything)
    apart = tables.apart(on_cpu) if tables is not None else 0
    tiering: ExpertTiering | None = None
    if inventory is not None:
        inventory = dataclasses.replace(inventory, resident_bytes=inventory.resident_bytes - apart)
        tiering = resolve_tiering(args, inventory, budget, on_cpu, args.load_format, prov.put)
        if tiering is not None:
            prov.put("tiered_experts", tiering.describe(inventory), "where moe_cache_size and moe_backing put them")
    if inventory is None:
        weights, tiered = everything - apart, ""
    elif tiering is None:
        weights, tiered = inventory.resident_bytes + inventory.all_expert_bytes, ""
    else:
        slots = tiering.cache_slots * inventory.expert_bytes
        rest = inventory.all_expert_bytes
        held = ("in host memory, pinned" if tiering.backing == "host" else "read from the checkpoint's files when "
                "needed")
        weights = inventory.resident_bytes + slots + (rest if on_cpu and tiering.backing == "host" else 0)
        tiered = (f"tiered experts: {format_bytes(rest)} {held}; {tiering.cache_slots} slots on the device "
                  f"({format_bytes(slots)}, in the weights)")
    context = args.max_model_len or config.max_position_embeddings
    layout = KVCacheLayout.of(model.cache_specs(dtype, context), args.block_size)
    num_checkpoints, _ = resolve_checkpoints(args, prov, layout, budget, weights, bool(args.enable_prefix_caching))
    if not on_cpu and layout.state_groups:
        prov.put("max_cudagraph_capture_size", 0, f"the {layout.state_groups[0].spec.kind} layers run eagerly")
    inputs = PlanInputs(
        budget, why, weights, layout.block_bytes // args.block_size, args.block_size,
        config.max_position_embeddings, args.max_num_seqs, on_cpu, activation, 0, layout.windows,
        args.max_num_seqs * layout.state_bytes_per_request, 0, layout.compressions,
        args.max_num_seqs * config.vocab_size * PENALTY_BYTES_PER_TOKEN, num_checkpoints,
        layout.checkpoint_bytes(args.block_size) if num_checkpoints else 0, "", tiered,
        tables.line if tables is not None else "")
    typed: dict[str, int] = {name: getattr(args, name) for name in
             ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks") if name in explicit}
    return ConfigPlan(plan_memory(inputs, typed, prov.put), layout, prov, parameters)
