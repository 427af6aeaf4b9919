"""Tiering a MoE model's routed experts at load, on meta, before any storage exists: each FusedMoE's stacked
expert tensors leave the module for a backing tier (host tensors the loader fills, or the checkpoint files'
locations, each expert read once now for the checksum its later reads are checked against), and one ExpertCache
of device slots, shared by every MoE layer, joins the model as buffers (so the weights the plan counts are what
the device holds)."""
from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from ladle.experts.backing import FileBacking, FilePart, HostBacking, compatible, tensor_locations
from ladle.experts.cache import ExpertCache
from ladle.experts.expert_files import ExpertFiles
from ladle.experts.tiered import MissPolicy, TieredExperts
from ladle.experts.tiering import ExpertInventory, ExpertTiering
from ladle.models.decoder import checkpoint_views
from ladle.models.interface import ConfiguredModel
from ladle.models.layers.moe import FusedMoE
from ladle.quantization.layer_interfaces import KeepsDtypes


def _held_dtype(t: torch.Tensor, keep: bool, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() and not keep else t.dtype


def _nbytes(t: torch.Tensor, keep: bool, dtype: torch.dtype) -> int:
    return t.numel() * _held_dtype(t, keep, dtype).itemsize


def expert_layers(model: nn.Module) -> list[tuple[str, FusedMoE]]:
    return [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FusedMoE)]


def _expert_shapes(module: FusedMoE, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    keep = module.keep_dtypes
    return {n: (tuple(getattr(module, n).shape[1:]), _held_dtype(getattr(module, n), n in keep, dtype))
            for n in module.expert_names()}


def expert_inventory(model: nn.Module, config: Any, dtype: torch.dtype) -> ExpertInventory | None:
    """The model's routed experts and the rest, in bytes as they will be held (None: no routed experts)."""
    layers = expert_layers(model)
    if not layers:
        return None
    shapes = _expert_shapes(layers[0][1], dtype)
    for prefix, m in layers:
        if _expert_shapes(m, dtype) != shapes or m.num_experts != layers[0][1].num_experts:
            raise ValueError(f"{prefix}'s experts differ in shape from {layers[0][0]}'s: tiered experts share one "
                             "cache of equal slots")
    total = 0
    for module in model.modules():
        keep = module.keep_dtypes if isinstance(module, KeepsDtypes) else ()
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None:
                total += _nbytes(t, name in keep, dtype)
    per_expert = sum(d.itemsize * math.prod(s) for s, d in shapes.values())
    experts = layers[0][1].num_experts
    return ExpertInventory(total - per_expert * experts * len(layers), per_expert, len(layers), experts,
                           int(config.num_experts_per_tok))


def tier_experts(model: ConfiguredModel, tiering: ExpertTiering, dtype: torch.dtype, device: torch.device,
                 files: list[str], renames: dict[str, str], top_k: int) -> set[str]:
    """Move every FusedMoE's experts to the tier (the model still on meta); returns the checkpoint names the
    loader must not read (the experts a file backing reads when needed)."""
    layers = expert_layers(model)
    shapes = _expert_shapes(layers[0][1], dtype)
    with torch.device("meta"):
        cache = ExpertCache(tiering.cache_slots, shapes, len(layers), top_k)
    cache.prefetch_enabled = tiering.prefetch
    policy = MissPolicy(tiering.strategy)
    stacks = {prefix: {n: getattr(m, n) for n in m.expert_names()} for prefix, m in layers}
    parts, skip = (_file_parts(model, stacks, shapes, files, renames) if tiering.backing == "mmap"
                   else ({}, set()))
    expert_files = ExpertFiles(p.location for by_expert in parts.values() for mine in by_expert.values() for p in mine)
    pin = device.type == "cuda"
    for layer, (prefix, m) in enumerate(layers):
        for name in m.expert_names():
            delattr(m, name)
        if tiering.backing == "mmap":
            backing: Any = FileBacking(_complete(prefix, parts.get(prefix, {}), m.num_experts, shapes), shapes,
                                       expert_files, prefix)
        else:
            backing = HostBacking({n: torch.empty((m.num_experts, *s), dtype=d, pin_memory=pin)
                                   for n, (s, d) in shapes.items()})
        m.tiered = TieredExperts(layer, backing, cache, policy, m.num_experts)
    for (_, m), (_, following) in pairwise(layers):
        assert m.tiered is not None  # set for every layer just above
        m.tiered.next = following.tiered
    model.attach_expert_cache(cache)
    return skip


def _file_parts(model: ConfiguredModel, stacks: dict[str, dict[str, torch.Tensor]],
                shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], files: list[str],
                renames: dict[str, str]) -> tuple[dict[str, dict[int, list[FilePart]]], set[str]]:
    """Each tiered layer's expert parts found in the files: where each checkpoint tensor lies and which rows
    of which expert's slot tensor it fills (from the view the layer's checkpoint_views gives, applied to the
    meta stack)."""
    views = checkpoint_views(model)
    name_of = model.checkpoint_name
    parts: dict[str, dict[int, list[FilePart]]] = {}
    skip: set[str] = set()
    for raw, loc in tensor_locations(files).items():
        found = views.get(name_of(renames.get(raw, raw)))
        target, view = found if found is not None else ("", None)
        prefix, _, param = target.rpartition(".")
        stack = stacks.get(prefix, {}).get(param)
        if stack is None or view is None:
            continue
        v = view(stack)
        if tuple(v.shape) != loc.shape:
            raise ValueError(f"{raw}: checkpoint shape {loc.shape} != expert tensor {tuple(v.shape)}")
        expert, within = divmod(int(v.storage_offset()), stack.stride(0))
        if not compatible(loc.dtype, shapes[param][1]):
            raise ValueError(f"{raw}: checkpoint dtype {loc.dtype} where the tiered expert holds {shapes[param][1]}")
        parts.setdefault(prefix, {}).setdefault(expert, []).append(FilePart(param, within // stack.stride(1), loc))
        skip.add(raw)
    return parts, skip


def _complete(prefix: str, parts: dict[int, list[FilePart]], num_experts: int,
              shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[list[FilePart]]:
    """Every expert's parts, checked to cover each of its tensors' rows once."""
    out = []
    for j in range(num_experts):
        mine = sorted(parts.get(j, []), key=lambda p: (p.name, p.row))
        for name, (shape, _) in shapes.items():
            rows = sum(p.location.shape[0] for p in mine if p.name == name)
            if rows != shape[0]:
                raise ValueError(f"the checkpoint holds {rows} of the {shape[0]} rows of {prefix} expert {j}'s {name}")
        out.append(sorted(mine, key=lambda p: p.location.offset))
    return out


def fill_dummy_experts(model: nn.Module, generator: torch.Generator) -> None:
    """load_format dummy: host-tiered experts drawn as init_dummy_weights draws parameters."""
    for _, m in expert_layers(model):
        if m.tiered is not None and isinstance(m.tiered.backing, HostBacking):
            for t in m.tiered.backing.tensors.values():
                t.normal_(0.0, 0.02, generator=generator)
