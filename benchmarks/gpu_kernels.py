"""Kernel-level sections of the device run (benchmarks/gpu_h200.py): the Triton kernels against the CPU
reference, attention alone at a few tile sizes and with split-KV decode, and decode steps eager vs replayed
from CUDA graphs."""
from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_graphs(core: Any, context: int, batches: tuple[int, ...]) -> dict:
    """Decode steps eager vs replayed from CUDA graphs (ladle.runner.cuda_graphs), on a scratch KV pool:
    step time at each batch size, and how far the graph's logits are from the eager ones."""
    from ladle.runner.cuda_graphs import DecodeGraphs
    from ladle.runner.inputs import build_step_inputs
    from ladle.runner.step_batch import StepBatch
    from ladle.runner.kv_allocation import allocate_kv_caches

    ec, model = core.config, core.model_executor.runner.model
    per_seq = -(-(context + 1) // ec.block_size)
    caches = allocate_kv_caches(ec.kv_layout, core.hf_config.num_hidden_layers, per_seq * max(batches), ec.device)
    t0 = time.perf_counter()
    graphs = DecodeGraphs(model, caches, ec.block_size, context + 1, max(batches), ec.device,
                          core.model_executor.runner.groups)
    if ec.device.type == "cuda":
        graphs.capture()
    res: dict[str, Any] = {"capture_s": round(time.perf_counter() - t0, 1), "sizes": list(graphs.sizes)}

    def eager(chunks: StepBatch) -> torch.Tensor:
        inputs = build_step_inputs(chunks, ec.block_size, ec.device, groups=core.model_executor.runner.groups)
        return model.compute_logits(model(inputs.input_ids, inputs.positions, caches, inputs.attn))

    for b in batches:
        chunks = StepBatch()
        for i in range(b):
            chunks.add([i + 1], context, list(range(i * per_seq, (i + 1) * per_seq)), True)
        res[f"batch{b}"] = _eager_vs_graph(chunks, eager, graphs.run, ec.device,
                                           "max_abs_logit_diff")
    return res


def _eager_vs_graph(chunks: Any, eager: Callable, graph: Callable, device: torch.device, diff_name: str) -> dict:
    """Each path's step time (20 steps after one warm-up) and the largest difference of their outputs. The CPU
    dry run times 2 steps: it checks the control flow (the Triton interpreter's times mean nothing), and each
    step there runs every kernel through the interpreter."""
    row: dict[str, Any] = {}
    outputs = {}
    reps = 20 if device.type == "cuda" else 2
    with torch.inference_mode():
        for name, fn in (("eager", eager), ("graph", graph)):
            fn(chunks)
            sync(device)
            t1 = time.perf_counter()
            for _ in range(reps):
                out = fn(chunks)
            sync(device)
            row[f"{name}_ms"] = round((time.perf_counter() - t1) * 1000 / reps, 3)
            outputs[name] = out.float().clone()
    row[diff_name] = float((outputs["graph"] - outputs["eager"]).abs().max())
    return dict(row, speedup=round(row["eager_ms"] / row["graph_ms"], 2))


def mixed_graphs(core: Any, context: int, steps: tuple[tuple[int, int], ...]) -> dict:
    """Steps with a prefill chunk eager vs replayed from CUDA graphs (ladle.runner.mixed_graphs), on a scratch
    KV pool: `decodes` decodes at `context` beside one `chunk`-token prefill chunk, for each (decodes, chunk);
    step time and how far the graph's hidden states (the sampled rows') are from the eager ones."""
    from ladle.attention.groups import reference_group
    from ladle.attention.triton_backend import TritonAttention
    from ladle.runner.inputs import build_step_inputs
    from ladle.runner.step_batch import StepBatch
    from ladle.runner.mixed_graphs import MixedGraphs
    from ladle.runner.kv_allocation import allocate_kv_caches

    ec, model = core.config, core.model_executor.runner.model
    most = max(d + c for d, c in steps)
    per_seq = -(-(context + most) // ec.block_size)
    seqs = max(d for d, _ in steps) + 1
    caches = allocate_kv_caches(ec.kv_layout, core.hf_config.num_hidden_layers, per_seq * seqs, ec.device)
    # Padding writes to slot -1, which only the Triton kernels skip: the dry run takes them, in the interpreter.
    groups = (core.model_executor.runner.groups if ec.device.type == "cuda"
              else (reference_group(backend=TritonAttention()),))
    t0 = time.perf_counter()
    graphs = MixedGraphs(model, caches, ec.block_size, context + most, most, seqs, ec.device, groups)
    if ec.device.type == "cuda":
        graphs.capture()
    res: dict[str, Any] = {"capture_s": round(time.perf_counter() - t0, 1), "sizes": list(graphs.sizes)}

    def table(i: int) -> list[int]:
        return list(range(i * per_seq, (i + 1) * per_seq))

    def eager(chunks: StepBatch) -> torch.Tensor:
        inputs = build_step_inputs(chunks, ec.block_size, ec.device, groups=groups)
        return model(inputs.input_ids, inputs.positions, caches, inputs.attn)

    for decodes, chunk in steps:
        chunks = StepBatch()
        for i in range(decodes):
            chunks.add([i + 1], context, table(i), True)
        chunks.add(list(range(1, chunk + 1)), context, table(decodes), True)
        row = _eager_vs_graph(chunks, eager, lambda c: graphs.run(c)[0], ec.device,
                              "max_abs_hidden_diff")
        res[f"decodes{decodes}_chunk{chunk}"] = dict(row, tokens=decodes + chunk,
                                                     graph_size=graphs.bucket(decodes + chunk))
    return res


def kernel_check(device: torch.device, small: bool) -> dict:
    """The Triton kernels against the CPU fp32 torch reference at the 8B head shape, on a mixed step."""
    from ladle.attention import torch_ref as reference
    from ladle.attention import triton_attention
    from ladle.runner.inputs import build_step_inputs
    from ladle.runner.step_batch import StepBatch

    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    page, heads, kvh, dim, nblocks = (16, 8, 2, 32, 40) if small else (16, 32, 8, 128, 700)
    requests = [(0, 700), (1500, 300), (2999, 1), (16, 1), (0, 1), (511, 1), (64, 40), (4000, 1)]
    requests = [(0, 19), (21, 13), (47, 1), (0, 1)] if small else requests
    free = torch.randperm(nblocks, generator=g).tolist()
    chunks = StepBatch()
    for start, n in requests:
        need = -(-(start + n) // page)
        chunks.add([0] * n, start, free[:need], True)
        free = free[need:]
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)):
        kc, vc = (torch.randn(nblocks, page, kvh, dim, generator=g).to(dtype) for _ in range(2))
        step = build_step_inputs(chunks, page)
        t = step.num_tokens
        q, k, v = (torch.randn(t, h, dim, generator=g).to(dtype) for h in (heads, kvh, kvh))
        kr, vr = kc.float(), vc.float()
        want = reference.paged_attention(q.float(), k.float(), v.float(), kr, vr, step.attn, dim**-0.5)
        gpu = build_step_inputs(chunks, page, device)
        kd, vd = kc.to(device), vc.to(device)
        got = triton_attention.paged_attention(q.to(device), k.to(device), v.to(device), kd, vd, gpu.attn, dim**-0.5)
        err = (got.float().cpu() - want).abs().max().item()
        pool_ok = torch.equal(kd.float().cpu(), kr) and torch.equal(vd.float().cpu(), vr)
        res[str(dtype).removeprefix("torch.")] = dict(max_abs_err=err, tol=tol, ok=bool(err <= tol and pool_ok))
    res["ok"] = all(v["ok"] for v in res.values())
    return res


def _attention_case(reqs: list[tuple[int, int]], device: torch.device) -> tuple:
    """(step metadata, q, k pool, v pool, FLOPs, KV bytes read) of bf16 attention at the 8B head shape for
    requests (tokens cached, new tokens), each on shuffled blocks of one scratch pool."""
    from ladle.runner.inputs import build_step_inputs
    from ladle.runner.step_batch import StepBatch

    page, heads, kvh, dim = 16, 32, 8, 128
    blocks = iter(torch.randperm(sum(-(-(s + n) // page) for s, n in reqs)).tolist())
    chunks = StepBatch()
    for s, n in reqs:
        chunks.add([0] * n, s, [next(blocks) for _ in range(-(-(s + n) // page))], True)
    step = build_step_inputs(chunks, page, device)
    nb = sum(len(t[0]) for t in chunks.block_ids)
    kc, vc = (torch.randn(nb, page, kvh, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(step.num_tokens, heads, dim, device=device, dtype=torch.bfloat16)
    flops = sum(4.0 * heads * dim * n * (s + (n + 1) / 2) for s, n in reqs)
    kv_bytes = sum(2.0 * (s + n) * kvh * dim * 2 for s, n in reqs)
    return step.attn, q, kc, vc, flops, kv_bytes


def _timed(fn: Callable[[], Any], flops: float, kv_bytes: float, device: torch.device, reps: int = 5) -> dict:
    fn()  # compile and warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    ms = start.elapsed_time(end) / reps
    return dict(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), kv_gb_s=round(kv_bytes / ms / 1e6, 1))


def kernel_speed(device: torch.device) -> dict:
    """Attention alone at the 8B head shape: a long prefill chunk (TFLOP/s) and a wide decode (GB/s of KV
    read), for the default tiles and a few others, so the next round can retune without a sweep; and a
    lone long decode with the automatic split-KV path against one pass (num_splits=1)."""
    from ladle.attention import triton_attention as ta
    from ladle.attention.triton_decode import num_splits_for

    dim = 128
    cases = {"prefill_8192_at_8192": [(8192, 8192)], "decode_256_at_2048": [(2047, 1)] * 256}
    tiles = {"default": None, "64x64w4": ta.TileConfig(64, 64, 4, 2), "128x64w8": ta.TileConfig(128, 64, 8, 2),
             "16x64w4": ta.TileConfig(16, 64, 4, 2), "16x128w4": ta.TileConfig(16, 128, 4, 2)}
    res: dict[str, Any] = {}
    for name, reqs in cases.items():
        attn, q, kc, vc, flops, kv_bytes = _attention_case(reqs, device)
        for label, tile in tiles.items():
            run = partial(ta.attention, q, kc, vc, attn, dim**-0.5, tiles=tile)
            res[f"{name}/{label}"] = _timed(run, flops, kv_bytes, device)
    res.update(sdpa_peer(device))
    for context in (8192, 131072):
        attn, q, kc, vc, flops, kv_bytes = _attention_case([(context - 1, 1)], device)
        auto = num_splits_for(1, kc.shape[2], device)
        for label, splits in ((f"auto{auto}", None), ("splits1", 1)):
            run = partial(ta.attention, q, kc, vc, attn, dim**-0.5, num_splits=splits)
            res[f"decode_1_at_{context}/{label}"] = _timed(run, flops, kv_bytes, device)
    return res


def sdpa_peer(device: torch.device, cached: int = 8192, new: int = 8192) -> dict:
    """torch's own SDPA (FlashAttention-2 on CUDA) on the prefill case, as the peer the Triton kernel is
    chosen against: once on K/V already contiguous (the kernel's speed of light in torch), once including
    the gather of the request's blocks a backend built on it would pay each step. Bottom-right causal
    alignment, as a chunk after `cached` tokens needs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    attn, q, kc, vc, flops, kv_bytes = _attention_case([(cached, new)], device)
    ctx = cached + new
    table = attn.block_tables[0, : -(-ctx // kc.shape[1])].long()

    def gather(pool: torch.Tensor) -> torch.Tensor:
        return pool.index_select(0, table).flatten(0, 1)[:ctx].transpose(0, 1)[None]  # [1, kvh, ctx, D]

    qs, mask = q.transpose(0, 1)[None], causal_lower_right(new, ctx)
    k, v = gather(kc), gather(vc)
    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    res: dict[str, Any] = {}
    for label, fn in (("sdpa_flash", lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)),
                      ("gather+sdpa_flash", lambda: F.scaled_dot_product_attention(
                          qs, gather(kc), gather(vc), attn_mask=mask, enable_gqa=True))):
        try:
            with sdpa_kernel(backend):
                res[f"prefill_{new}_at_{cached}/{label}"] = (
                    _timed(fn, flops, kv_bytes, device) if device.type == "cuda" else {"shape": list(fn().shape)})
        except Exception as e:  # noqa: BLE001 - a backend this torch lacks is a finding, not a failed run
            res[f"prefill_{new}_at_{cached}/{label}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return res
