"""Startup: measure the device, load the weights, profile activations, plan memory, resolve every setting.

The same path serves the engine and `ladle plan`, so the plan printed is the plan the engine runs with.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ladle.attention.groups import attention_groups
from ladle.attention.selector import resolve_backend, select_backend
from ladle.config.engine_args import EngineArgs, check_max_model_len
from ladle.config.provenance import Provenance, resolve_basics, resolve_cudagraph_mode, resolve_cudagraph_size
from ladle.config.sizes import format_bytes, parse_bytes
from ladle.config.speculative import parse_speculative_config
from ladle.distributed.parallel_state import SINGLE, TensorParallel
from ladle.gguf.path import gguf_file_of
from ladle.kv_cache.specs import KVCacheLayout
from ladle.models.interface import ConfiguredModel
from ladle.models.loading.loader import load_config, load_model
from ladle.quantization.apply import weights_format
from ladle.quantization.config import resolve_quantization
from ladle.runner.block_table import BlockTableBuffer
from ladle.runner.disk_kv_writer import DiskKVWriter
from ladle.runner.host_kv_cache import HostCheckpointCache, HostKVCache
from ladle.runner.kv_allocation import allocate_checkpoint_tails, allocate_kv_caches
from ladle.runner.model_runner import ModelRunner
from ladle.runner.penalty_counts import PENALTY_BYTES_PER_TOKEN
from ladle.startup import profile_cache
from ladle.startup.checkpoints import resolve_checkpoints, resolve_interval
from ladle.startup.cpu_isa import resolve_cpu_isa
from ladle.startup.engine_config import EngineConfig
from ladle.startup.expert_tiers import calibrate_tiers, tiered_bytes, tiered_line, tiering_resolver
from ladle.startup.kv_disk import resolve_kv_disk
from ladle.startup.memory import device_budget, free_memory_bytes, total_memory_bytes
from ladle.startup.partial_prefill import resolve_partial_prefills
from ladle.startup.planner import MemoryPlan, PlanInputs, plan_memory
from ladle.startup.ple_tables import TablePlacement, place_tables
from ladle.startup.profiling import ProfilePoint, fit_activation_model, profile_points, profile_shapes
from ladle.startup.speculative import draft_rows_per_request, mtp_drafts, mtp_limits, resolve_speculative
from ladle.startup.threads import apply_threads, keep_lending, resolve_lending, resolve_threads, usable_cpus

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class Loaded:
    model: ConfiguredModel
    hf_config: PretrainedConfig
    config: EngineConfig


def profile_token_counts(max_len: int) -> list[int]:
    """Step sizes to profile, each no longer than max_len: a spread up to 2048, beyond which the fitted
    model is linear in tokens (tests check predictions against fresh measurements)."""
    return sorted({min(t, max_len) for t in (64, 512, 2048)})


def _activation_profile(args: EngineArgs, prov: Provenance, model: ConfiguredModel, hf_config: PretrainedConfig,
                        layout: KVCacheLayout, device: torch.device, context: int,
                        backend: str, tp: TensorParallel) -> list[ProfilePoint]:
    """The profiled points: from the cache when an entry matches (unless profile_cache is off), else measured
    now and stored for the next start. Tensor-parallel ranks profile together (the forward runs collectives),
    so they use their cache entries only if every rank has one."""
    token_counts = profile_token_counts(context)
    rows = sorted({min(r, args.max_num_seqs) for r in (16, 64, 128)})
    dtype = layout.groups[0].spec.dtype
    key = profile_cache.profile_key(hf_config, dtype, device, block_size=args.block_size, context=context,
                                    token_counts=token_counts, rows=rows, attention_backend=backend,
                                    tensor_parallel=(tp.rank, tp.world_size),
                                    tiered=getattr(prov.settings.get("tiered_experts"), "value", ""),
                                    ple_table=getattr(prov.settings.get("ple_table"), "value", ""))
    use_cache = prov.put("profile_cache", bool(args.profile_cache))
    # A measured peak can never exceed the device's memory, so that bounds a cached one.
    cached = profile_cache.load(key, profile_shapes(token_counts, context, rows),
                                total_memory_bytes(device)) if use_cache else None
    if tp.all_min([cached is not None])[0] == 0:
        cached = None
    if cached is not None:
        prov.put("activation_profile", "cached", f"from {profile_cache.cache_dir() / key}.json")
        return cached
    points = profile_points(model, layout, device, hf_config.vocab_size, token_counts, context, rows,
                            attention_backend=backend)
    stored = profile_cache.store(key, points)
    why = "no cache entry for this model, dtype, device and code" if use_cache else "profile_cache is off"
    prov.put("activation_profile", "measured",
             f"profiled at startup ({why})" + ("; stored for the next start" if stored else ""))
    return points


def _state_limits(prov: Provenance, layout: KVCacheLayout, graph_batch: int) -> int:
    """The state layers have no graph-safe path: an explicit request for graphs is refused, the default is
    derived off, with the reason."""
    kind = layout.state_groups[0].spec.kind
    if graph_batch:
        why = f"the {kind} layers run eagerly (no CUDA-graph path for them yet)"
        if "max_cudagraph_capture_size" in prov.explicit:
            raise ValueError(f"max_cudagraph_capture_size cannot be used with this model: {why}; drop it")
        prov.put("max_cudagraph_capture_size", 0, why)
    return 0


def _graph_limit(prov: Provenance, graph_batch: int, why: str) -> int:
    """No CUDA graphs for this model, and why; an explicit request for them is refused."""
    for name in ("max_cudagraph_capture_size", "cudagraph_mode"):
        if name in prov.explicit:
            raise ValueError(f"{name} cannot be used with this model: {why}; drop it")
    return prov.put("max_cudagraph_capture_size", 0, why)


def _tensor_parallel_limits(prov: Provenance, args: EngineArgs, graph_batch: int) -> tuple[int, bool]:
    """What a tensor-parallel group does not do yet: launch a step ahead (the other ranks run each step as
    rank 0 sends it), or replay CUDA graphs (they would hold the collectives). Explicit requests are refused."""
    for name, value in (("async_scheduling", args.async_scheduling), ("max_cudagraph_capture_size", graph_batch)):
        if value and name in prov.explicit:
            raise ValueError(f"{name} cannot be used with tensor_parallel_size > 1 yet; drop it")
    why = "tensor-parallel steps run eagerly, one at a time, as rank 0 sends them"
    prov.put("max_cudagraph_capture_size", 0, why)
    prov.put("async_scheduling", False, why)
    return 0, False


HOST_TIER_POOL_MULTIPLE = 2  # a derived host tier holds twice the device pool (SGLang HiCache's default ratio)
HOST_TIER_SHARE_OF_FREE = 0.25  # and never more than this share of the host's free memory


def _host_tier(args: EngineArgs, prov: Provenance, layout: KVCacheLayout, prefix_caching: bool,
               device: torch.device, num_kv_blocks: int, num_checkpoints: int, interval: int) -> tuple[int, int]:
    """kv_offloading_size as (blocks, state checkpoints) of the layout: a model with state checkpoints keeps one
    per `interval` tokens of blocks, the density its prefills write them at (a hit needs both; a model without
    gives it all to blocks); refused where it could hold nothing.
    Without it: on CUDA, twice the device's prefix cache within a quarter of the free host memory (a hit copied
    over PCIe beats recomputing its history); on CPU none, since there the pool is host memory already and a
    larger pool serves the same hits without the copies. 0 turns it off."""
    block, checkpoint = layout.block_bytes, layout.checkpoint_bytes(layout.block_size) if num_checkpoints else 0
    device_bytes = num_kv_blocks * block + num_checkpoints * checkpoint
    if args.kv_offloading_size is None:
        if not prefix_caching:
            prov.put("kv_offloading_size", "off", "prefix caching is off: the host tier keeps only cached blocks")
            return 0, 0
        if device.type != "cuda":
            prov.put("kv_offloading_size", "off", "on CPU the KV pool is host memory already: a larger pool "
                     "(kv_cache_memory_bytes) serves the same hits without copies")
            return 0, 0
        free = free_memory_bytes(torch.device("cpu"))
        size = min(HOST_TIER_POOL_MULTIPLE * device_bytes, int(free * HOST_TIER_SHARE_OF_FREE))
        why = (f"{HOST_TIER_POOL_MULTIPLE}x the device pool, within a quarter of the {format_bytes(free)} free "
               "host memory")
    else:
        size = parse_bytes(args.kv_offloading_size, "kv_offloading_size", allow_zero=True)
        if not size:
            prov.put("kv_offloading_size", "off", "")
            return 0, 0
        if not prefix_caching:
            raise ValueError("kv_offloading_size keeps the prefix cache's evicted blocks, but enable_prefix_caching "
                             "is off; turn it on or drop kv_offloading_size")
        why = ""
    checkpoints = size // (max(1, interval // layout.block_size) * block + checkpoint) if checkpoint else 0
    if checkpoint and not checkpoints and size >= checkpoint + block:
        checkpoints = 1
    blocks = (size - checkpoints * checkpoint) // block
    if blocks < 1:
        if args.kv_offloading_size is None:
            prov.put("kv_offloading_size", "off", f"a quarter of the {format_bytes(free)} free host memory holds "
                     "no block")
            return 0, 0
        raise ValueError(f"kv_offloading_size={args.kv_offloading_size!r} holds no block of this model "
                         f"({format_bytes(block)} each); give at least that much")
    held = f"{blocks} blocks" + (f", {checkpoints} state checkpoints" if checkpoints else "")
    prov.put("kv_offloading_size", f"{format_bytes(size)} ({held})", why)
    return blocks, checkpoints


def build_runner(model: ConfiguredModel, cfg: EngineConfig) -> ModelRunner:
    """The KV caches, block tables and attention backends the plan sized, and the runner over them."""
    layout = cfg.kv_layout
    assert layout is not None  # planned before any runner is built
    # A model with state layers keeps one state slot per running request, then its checkpoints (the plan
    # reserved them).
    slots = cfg.max_num_seqs if layout.state_groups else 0
    # Speculative decoding on such a model: after them, k rows per slot for the states after each draft.
    drafts = draft_rows_per_request(layout, cfg.speculative)
    caches = allocate_kv_caches(layout, layout.num_layers, cfg.num_kv_blocks, cfg.device,
                                slots * (1 + drafts) + cfg.num_state_checkpoints)
    tails = allocate_checkpoint_tails(layout, cfg.num_state_checkpoints, cfg.device)
    # Room for every running request, and as many again for preempted ones coming back; one per group.
    tables = [BlockTableBuffer(2 * cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_size))
              for _ in layout.groups]
    groups = attention_groups(layout, cfg.device, cfg.attention_backend)
    host_kv, disk_writer, host_checkpoints = None, None, None
    if cfg.num_host_checkpoints:
        host_checkpoints = HostCheckpointCache(
            [t for g in layout.state_groups for layer in g.layers for t in caches[layer]], list(tails.values()),
            slots, cfg.num_host_checkpoints)
    if cfg.num_host_kv_blocks:
        paged = {id(t): t for g in layout.groups for layer in g.layers for t in caches[layer]}
        host_kv = HostKVCache(list(paged.values()), cfg.num_host_kv_blocks)
        if cfg.kv_disk is not None:  # its copies wait for the disk in host memory, at most the host tier's size
            backlog = (cfg.num_host_kv_blocks * layout.block_bytes
                       + cfg.num_host_checkpoints * layout.checkpoint_bytes(cfg.block_size))
            disk_writer = DiskKVWriter(list(paged.values()), cfg.kv_disk.directory, backlog,
                                       host_checkpoints.rows if host_checkpoints is not None else None)
    return ModelRunner(model, caches, cfg.block_size, cfg.device,
                       tables, groups, layout.state_groups,
                       cfg.max_num_seqs, cfg.seed, checkpoint_tails=tails, first_checkpoint=slots,
                       draft_rows=(slots + cfg.num_state_checkpoints, drafts), mtp_drafts=mtp_drafts(cfg.speculative),
                       host_kv=host_kv, disk_writer=disk_writer, host_checkpoints=host_checkpoints)


def agree_on_plan(plan: MemoryPlan, tp: TensorParallel, prov: Provenance) -> MemoryPlan:
    """Every rank's plan fits its own memory, and using less of anything never costs more, so the element-wise
    smallest plan fits every rank (a chunk cap stays within the step budget: each rank's did)."""
    names = ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks")
    own = [getattr(plan, n) for n in names]
    agreed = tp.all_min(own)
    ranks = tuple(f"rank {r}: {line}" for r, line in enumerate(tp.all_gather_object(plan.summary())))
    for name, mine, value in zip(names, own, agreed):
        if value != mine:
            prov.put(name, value, f"the smallest of the {tp.world_size} tensor-parallel ranks' plans (rank "
                                  f"{tp.rank}'s: {mine})")
    max_model_len, max_num_batched_tokens, max_prefill_length, num_kv_blocks = agreed
    return dataclasses.replace(plan, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                               max_prefill_length=max_prefill_length, num_kv_blocks=num_kv_blocks, ranks=ranks)


def load_and_plan(args: EngineArgs, explicit: frozenset[str], tp: TensorParallel = SINGLE) -> Loaded:
    """Every rank of a tensor-parallel group runs this at once, on its own shard; the ranks agree on one plan."""
    prov = Provenance(explicit)
    device, dtype = resolve_basics(args, prov)
    if device.type == "cuda" and tp.world_size > 1:
        device = torch.device("cuda", tp.rank)
        torch.cuda.set_device(device)
    # Before anything runs in parallel: torch's thread team is created at the first parallel op, and its
    # threads inherit this thread's CPU mask.
    num_threads = resolve_threads(args, prov, tp.world_size)
    # Bound only where every rank's share fits beside the reserved CPUs.
    pin = args.reserved_cpus > 0 and tp.world_size * num_threads <= len(usable_cpus()) - args.reserved_cpus
    lending = resolve_lending(args, prov, num_threads, pin, tp.world_size) if device.type == "cpu" else None
    bound = apply_threads(num_threads, device, pin=pin, first=tp.rank * num_threads, lending=lending)
    if device.type == "cpu":
        resolve_cpu_isa(prov)
    if bound is not None:
        prov.put("cpu_binding", " ".join(map(str, bound)),
                 f"OpenMP thread i on the i-th of these CPUs, as vLLM binds; {args.reserved_cpus} left to the API "
                 "process" + (" (see lent_cpus)" if lending else ""))
    free, total = free_memory_bytes(device), total_memory_bytes(device)
    if device.type == "cpu" and tp.world_size > 1:  # the ranks share the host's memory
        free, total = free // tp.world_size, total // tp.world_size
    user_cap = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    budget, budget_reason = device_budget(device, args.gpu_memory_utilization, user_cap, free, total)
    prov.put("memory_budget", f"{budget / 2**30:.2f} GiB", budget_reason)
    if device.type == "cuda":
        prov.put("gpu_memory_utilization", args.gpu_memory_utilization)

    hf_config = load_config(args.model)
    quant, value, why = resolve_quantization(args.quantization, hf_config)
    gguf = gguf_file_of(args.model) is not None  # block-quantized by its tensors' types, not by a config
    if gguf and quant is None:
        value, why = "gguf", ("the GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K linears stay blocks on "
                              "CPU (widened on other devices); every other tensor is widened to dtype"
                              + (", MoE experts included (no grouped block kernel yet)"
                                 if getattr(hf_config, "num_experts", None) else ""))
    prov.put("quantization", value, "" if "quantization" in prov.explicit else why)
    if args.dequantize_weights and quant is None and not gguf:
        raise ValueError("dequantize_weights is set, but the checkpoint is unquantized: nothing to widen; drop it")
    prov.put("dequantize_weights", args.dequantize_weights,
             "" if "dequantize_weights" in prov.explicit else "the checkpoint's quantized weights stay quantized"
             if quant is not None or gguf else "an unquantized checkpoint: nothing to widen")
    model_max = hf_config.max_position_embeddings
    if args.max_model_len is not None:
        check_max_model_len(args.max_model_len, model_max)
    speculative = parse_speculative_config(args.speculative_config)
    mtp = speculative is not None and speculative.method == "mtp"
    tables: list[TablePlacement] = []

    def place(meta_model: nn.Module) -> int:
        placed = place_tables(meta_model, args, budget, device.type == "cpu", dtype, prov.put)
        tables.extend([placed] if placed is not None else [])
        return placed.apart(device.type == "cpu") if placed is not None else 0

    model, hf_config = load_model(args.model, device, dtype, args.load_format, args.seed, hf_config, tp,
                                  args.dequantize_weights, tiering_resolver(args, prov, budget, device), mtp, place)
    lending = keep_lending(lending, model, prov)
    if model.cpu_kernels is not None and device.type == "cpu":
        prov.put("cpu_kernels", *model.cpu_kernels)
    host_experts, tiered = tiered_line(model, device)
    calibrate_tiers(model, prov, device, dtype)
    # A table held in host memory is not the device's (on CPU everything is).
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                  if t.device.type == device.type) + host_experts
    if weights >= budget:
        raise ValueError(f"the weights ({format_bytes(weights)}) do not fit in the memory budget "
                         f"({format_bytes(budget)}, {budget_reason}); raise memory_budget")
    context = args.max_model_len or model_max
    layout = KVCacheLayout.of(model.cache_specs(dtype, context), args.block_size)
    graph_batch = resolve_cudagraph_size(args, device, prov)
    prefix_caching = bool(args.enable_prefix_caching)
    if layout.state_groups:
        graph_batch = _state_limits(prov, layout, graph_batch)
    num_checkpoints, prefix_caching = resolve_checkpoints(args, prov, layout, budget, weights, prefix_caching)
    if any(g.spec.compression != (1, 1) for g in layout.groups) and graph_batch:
        graph_batch = _graph_limit(prov, graph_batch, "compressed KV groups: the model builds their entries "
                                   "request by request from host copies, which a graph cannot replay")
    if tiered and graph_batch:
        graph_batch = _graph_limit(prov, graph_batch, "tiered experts: a step fetches the experts its tokens route "
                                   "to, which a graph cannot replay")
    async_scheduling = bool(args.async_scheduling)
    if async_scheduling and layout.state_groups and tiered_bytes(model)[1]:
        raise ValueError("async_scheduling cannot be used with moe_backing mmap on a model with state layers yet: a "
                         "step launched ahead that finds an expert's file changed cannot be taken back (its state "
                         "layers already ran); drop async_scheduling or use moe_backing host")
    if tp.world_size > 1:
        graph_batch, async_scheduling = _tensor_parallel_limits(prov, args, graph_batch)
    if mtp:
        graph_batch, async_scheduling = mtp_limits(prov, args, graph_batch)
    graph_mode = resolve_cudagraph_mode(args, graph_batch, prov)
    backend, why = resolve_backend(device, args.attention_backend)
    prov.put("attention_backend", backend, why)
    for group in layout.groups:
        select_backend(device, group.spec, backend)  # fails now, with the reason, if a group has no backend here

    speculative = resolve_speculative(speculative, prov, layout, device)
    points = _activation_profile(args, prov, model, hf_config, layout, device, context, backend, tp)
    # A decode row with k drafts samples k + 1 positions: the logits and sampling rows a step may hold.
    activation = fit_activation_model(points, args.max_num_seqs * (1 + (speculative.num_speculative_tokens
                                                                          if speculative else 0)))

    # A graph's pool holds one step's activations for good, the largest captured step's (graphs share it):
    # the decode profile bounds a decode graph's (it also counts sampling, which runs outside the graph), the
    # prefill profile at the largest captured token count a mixed step's.
    graph_bytes = activation.predict_decode(graph_batch) if graph_batch else 0
    if graph_mode == "FULL":
        graph_bytes = max(graph_bytes, activation.predict(graph_batch, context))
    drafts = draft_rows_per_request(layout, speculative)
    inputs = PlanInputs(budget, budget_reason, weights, layout.block_bytes // args.block_size, args.block_size,
                        model_max, args.max_num_seqs, device.type == "cpu", activation, graph_bytes, layout.windows,
                        args.max_num_seqs * (1 + drafts) * layout.state_bytes_per_request, drafts, layout.compressions,
                        args.max_num_seqs * hf_config.vocab_size * PENALTY_BYTES_PER_TOKEN, num_checkpoints,
                        layout.checkpoint_bytes(args.block_size) if num_checkpoints else 0, weights_format(model),
                        tiered, tables[0].line if tables else "")
    typed: dict[str, int] = {name: getattr(args, name) for name in
             ("max_model_len", "max_num_batched_tokens", "max_prefill_length", "num_kv_blocks") if name in explicit}
    if "kv_cache_memory_bytes" in explicit and "num_kv_blocks" not in explicit:
        assert args.kv_cache_memory_bytes is not None  # explicit: the flag was given a value
        typed["kv_cache_memory_bytes"] = parse_bytes(args.kv_cache_memory_bytes)
    plan = plan_memory(inputs, typed, prov.put)
    if tp.world_size > 1:
        plan = agree_on_plan(plan, tp, prov)
    limits = resolve_partial_prefills(args, prov, plan.max_num_batched_tokens)
    interval = resolve_interval(args, prov, min(plan.max_prefill_length, plan.max_num_batched_tokens),
                                num_checkpoints)
    prov.put("tensor_parallel_size", tp.world_size)
    host_blocks, host_checkpoints = _host_tier(args, prov, layout, prefix_caching, device, plan.num_kv_blocks,
                                               num_checkpoints, interval)
    checkpointing = bool(layout.state_groups) or any(c != (1, 1) for c in layout.compressions)
    kv_disk = resolve_kv_disk(args, prov, layout, dtype, value, host_blocks, host_checkpoints if checkpointing else 0,
                              checkpointing, tp.world_size)
    config = EngineConfig(
        model=args.model, tokenizer=args.tokenizer or args.model, device=device, dtype=dtype,
        max_model_len=plan.max_model_len, max_num_batched_tokens=plan.max_num_batched_tokens,
        max_prefill_length=plan.max_prefill_length, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
        num_kv_blocks=plan.num_kv_blocks, seed=args.seed, enable_prefix_caching=prefix_caching,
        num_host_kv_blocks=host_blocks, num_host_checkpoints=host_checkpoints, kv_disk=kv_disk,
        num_state_checkpoints=num_checkpoints, state_checkpoint_interval=interval,
        max_cudagraph_capture_size=graph_batch, cudagraph_mode=graph_mode, async_scheduling=async_scheduling,
        partial_prefills=limits, scheduling_policy=args.scheduling_policy, attention_backend=backend,
        settings=prov.settings, plan=plan, kv_layout=layout, cpu_lending=lending, speculative=speculative,
    )
    return Loaded(model, hf_config, config)
