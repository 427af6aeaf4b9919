"""Startup: measure the device, load the weights, profile activations, plan memory, resolve every setting.

The same path serves the engine and `ladle plan`, so the plan printed is the plan the engine runs with.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ladle.config import EngineArgs, EngineConfig, Provenance, resolve_basics, resolve_cudagraph_size
from ladle.engine.memory import device_budget, free_memory_bytes, parse_bytes, total_memory_bytes
from ladle.engine.planner import PlanInputs, plan_memory
from ladle.engine.profiling import fit_activation_model, profile_points
from ladle.models.loader import kv_cache_shape_params, load_model

logger = logging.getLogger("ladle")


@dataclass
class Loaded:
    model: torch.nn.Module
    hf_config: object
    config: EngineConfig


def profile_token_counts(max_len: int) -> list[int]:
    """Step sizes to profile, each no longer than max_len: a spread up to 2048, beyond which the fitted
    model is linear in tokens (tests check predictions against fresh measurements)."""
    return sorted({min(t, max_len) for t in (64, 512, 2048)})


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
    model, hf_config = load_model(args.model, device, dtype, args.load_format, args.seed)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if weights >= budget:
        raise ValueError(f"the weights ({weights / 2**20:.1f} MiB) do not fit in the memory budget "
                         f"({budget / 2**20:.1f} MiB, {budget_reason}); raise --memory-budget")
    model_max = hf_config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > model_max:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings="
                         f"{model_max}; set max_model_len <= {model_max}")
    kv_shape = kv_cache_shape_params(hf_config)
    num_layers, num_kv_heads, head_dim = kv_shape
    kv_bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    context = args.max_model_len or model_max
    rows = sorted({min(r, args.max_num_seqs) for r in (16, 64, 128)})
    points = profile_points(model, kv_shape, dtype, device, args.block_size, hf_config.vocab_size,
                            profile_token_counts(context), context, rows)
    activation = fit_activation_model(points, args.max_num_seqs)
    logger.info("activation model: %s", activation.describe())

    # A graph's pool holds one decode step's activations for good; the decode profile bounds it from above
    # (it also counts sampling, which runs outside the graph).
    graph_bytes = activation.predict_decode(graph_batch) if graph_batch else 0
    inputs = PlanInputs(budget, budget_reason, weights, kv_bytes_per_token, args.block_size, model_max,
                        args.max_num_seqs, device.type == "cpu", activation, graph_bytes)
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
        settings=prov.settings, plan=plan,
    )
    return Loaded(model, hf_config, config)
