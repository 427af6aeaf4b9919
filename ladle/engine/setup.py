"""Startup: measure the device, load the weights, profile activations, plan memory, resolve every setting.

The same path serves the engine and `ladle plan`, so the plan printed is the plan the engine runs with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.config import (
    EngineArgs, EngineConfig, Provenance, check_max_model_len, format_bytes, parse_bytes, resolve_basics,
    resolve_cudagraph_size,
)
from ladle.engine.memory import device_budget, free_memory_bytes, total_memory_bytes
from ladle.engine import profile_cache
from ladle.engine.planner import PlanInputs, plan_memory
from ladle.engine.profiling import ProfilePoint, fit_activation_model, profile_points
from ladle.attention.backends import select_backend
from ladle.kv_cache.specs import AttentionSpec, KVCacheLayout, group_layers
from ladle.models.decoder import layer_windows
from ladle.models.loader import kv_cache_shape_params as kv_shape_of, load_config, load_model


@dataclass
class Loaded:
    model: torch.nn.Module
    hf_config: object
    config: EngineConfig


def profile_token_counts(max_len: int) -> list[int]:
    """Step sizes to profile, each no longer than max_len: a spread up to 2048, beyond which the fitted
    model is linear in tokens (tests check predictions against fresh measurements)."""
    return sorted({min(t, max_len) for t in (64, 512, 2048)})


def _activation_profile(args: EngineArgs, prov: Provenance, model: torch.nn.Module, hf_config: object,
                        layout: KVCacheLayout, device: torch.device, context: int) -> list[ProfilePoint]:
    """The profiled points: from the cache when an entry matches (unless profile_cache is off), else measured
    now and stored for the next start."""
    token_counts = profile_token_counts(context)
    rows = sorted({min(r, args.max_num_seqs) for r in (16, 64, 128)})
    dtype = layout.groups[0].spec.dtype
    key = profile_cache.profile_key(hf_config, dtype, device, block_size=args.block_size, context=context,
                                    token_counts=token_counts, rows=rows)
    use_cache = prov.put("profile_cache", bool(args.profile_cache))
    cached = profile_cache.load(key) if use_cache else None
    if cached is not None:
        prov.put("activation_profile", "cached", f"from {profile_cache.cache_dir() / key}.json")
        return cached
    points = profile_points(model, layout, device, hf_config.vocab_size, token_counts, context, rows)
    stored = profile_cache.store(key, points)
    why = "no cache entry for this model, dtype, device and code" if use_cache else "profile_cache is off"
    prov.put("activation_profile", "measured",
             f"profiled at startup ({why})" + ("; stored for the next start" if stored else ""))
    return points


def load_and_plan(args: EngineArgs, explicit: frozenset[str]) -> Loaded:
    prov = Provenance(explicit)
    device, dtype = resolve_basics(args, prov)
    free, total = free_memory_bytes(device), total_memory_bytes(device)
    user_cap = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    budget, budget_reason = device_budget(device, args.gpu_memory_utilization, user_cap, free, total)
    prov.put("memory_budget", f"{budget / 2**30:.2f} GiB", budget_reason)
    if device.type == "cuda":
        prov.put("gpu_memory_utilization", args.gpu_memory_utilization)

    graph_batch = resolve_cudagraph_size(args, device, prov)
    hf_config = load_config(args.model)
    model_max = hf_config.max_position_embeddings
    if args.max_model_len is not None:
        check_max_model_len(args.max_model_len, model_max)
    model, hf_config = load_model(args.model, device, dtype, args.load_format, args.seed, hf_config)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if weights >= budget:
        raise ValueError(f"the weights ({format_bytes(weights)}) do not fit in the memory budget "
                         f"({format_bytes(budget)}, {budget_reason}); raise memory_budget")
    num_layers, num_kv_heads, head_dim = kv_shape_of(hf_config)
    layout = KVCacheLayout(group_layers([AttentionSpec(num_kv_heads, head_dim, dtype, w)
                                         for w in layer_windows(hf_config)]), args.block_size)
    for group in layout.groups:
        select_backend(device, group.spec)  # fails now, with the reason, if a group has no backend here

    context = args.max_model_len or model_max
    points = _activation_profile(args, prov, model, hf_config, layout, device, context)
    activation = fit_activation_model(points, args.max_num_seqs)

    # A graph's pool holds one decode step's activations for good; the decode profile bounds it from above
    # (it also counts sampling, which runs outside the graph).
    graph_bytes = activation.predict_decode(graph_batch) if graph_batch else 0
    inputs = PlanInputs(budget, budget_reason, weights, layout.block_bytes // args.block_size, args.block_size,
                        model_max, args.max_num_seqs, device.type == "cpu", activation, graph_bytes, layout.windows)
    typed = {name: getattr(args, name) for name in
             ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks") if name in explicit}
    if "kv_cache_memory_bytes" in explicit and "num_kv_blocks" not in explicit:
        typed["kv_cache_memory_bytes"] = parse_bytes(args.kv_cache_memory_bytes)
    plan = plan_memory(inputs, typed, prov.put)
    config = EngineConfig(
        model=args.model, tokenizer=args.tokenizer or args.model, device=device, dtype=dtype,
        max_model_len=plan.max_model_len, max_num_batched_tokens=plan.max_num_batched_tokens,
        max_prefill_length=plan.max_prefill_length, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
        num_kv_blocks=plan.num_kv_blocks, seed=args.seed, enable_prefix_caching=bool(args.enable_prefix_caching),
        max_cudagraph_capture_size=graph_batch, async_scheduling=bool(args.async_scheduling),
        settings=prov.settings, plan=plan, kv_layout=layout,
    )
    return Loaded(model, hf_config, config)
