"""Engine-level measurements of the device run (benchmarks/gpu_h200.py): generation through EngineCore.step()
with its timings, batch-1 decode synchronous and with async scheduling, the activation peak of a run, and
prefill speed straight through the model runner."""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable

import torch

from gpu_kernels import sync

GiB = 2**30

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (n, length), generator=g).tolist()


def generate(core: Any, batch: list[list[int]], new: int, ids: itertools.count, deadline: float = float("inf"),
             keep_tokens: bool = False) -> dict:
    """Run the batch through core.step() until done or past the deadline (then the rest is aborted);
    keep_tokens adds each request's tokens, in batch order."""
    from ladle.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    live, order, tokens = set(), [], {}
    for p in batch:
        req = core.make_request(f"r{next(ids)}", p, params)
        core.add_request(req)
        live.add(req.request_id)
        order.append(req.request_id)
    device = core.config.device
    steps_before, ahead_before = core.stats.num_steps, core.stats.steps_ahead
    out_tokens = finished = 0
    first = None
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        if live and time.perf_counter() > deadline:
            core.abort_requests(sorted(live))  # a step launched ahead still drains below, its tokens dropped
            live.clear()
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            out_tokens += len(o.new_token_ids)
            if first is None and out_tokens:
                first = time.perf_counter()
            if o.finish_reason is not None:
                finished += o.finish_reason in ("length", "stop")
                live.discard(o.request_id)
    sync(device)
    wall = time.perf_counter() - t0
    after_first = time.perf_counter() - (first or t0)
    n_steps = core.stats.num_steps - steps_before
    steps = list(core.stats.steps)[-n_steps:] if n_steps else []  # a bounded history: the latest records
    return dict(requests=len(batch), finished=finished, output_tokens=out_tokens, wall_s=round(wall, 3),
                steps=n_steps, largest_step=max((r.num_tokens for r in steps), default=0),
                output_tok_s=round(out_tokens / wall, 1), first_token_s=round((first or t0) - t0, 3),
                decode_tok_s=round((out_tokens - len(batch)) / after_first, 1) if after_first > 0 else None,
                steps_ahead=core.stats.steps_ahead - ahead_before, async_scheduling=core.config.async_scheduling,
                **({"tokens": [tokens.get(r, []) for r in order]} if keep_tokens else {}))


def set_async(core: Any, on: bool) -> None:
    """Switch the engine's async scheduling between runs (a benchmark-only toggle: the engine reads the flag
    from its config at every step, and no step is in flight between runs)."""
    core.config = dataclasses.replace(core.config, async_scheduling=on)


def decode_batch1(core: Any, prompt_len: int, new: int, vocab: int, ids: itertools.count, box: dict) -> dict:
    """Batch-1 decode, synchronous (the default) and with async scheduling; their greedy tokens must agree,
    and only then does the offline section run with async scheduling."""
    batch = prompts(1, prompt_len, vocab, 2)
    res = generate(core, batch, new, ids, keep_tokens=True)
    set_async(core, True)
    try:
        ahead = generate(core, batch, new, ids, keep_tokens=True)
    finally:
        set_async(core, False)
    box["async_ok"] = same = res.pop("tokens") == ahead.pop("tokens")
    return dict(res, async_decode_tok_s=ahead["decode_tok_s"], async_tokens_identical=same, async_run=ahead)


def peak(core: Any, fn: Callable[[], dict]) -> dict:
    """fn's result plus the activation peak it caused (above weights + KV pool) and the device total."""
    from ladle.startup.memory import measure_peak

    box: dict[str, dict] = {}
    device = core.config.device
    act = measure_peak(lambda: box.setdefault("r", fn()), device)
    res = box["r"]
    res["activation_peak_gib"] = round(act / GiB, 3)
    res["plan_activation_peak_gib"] = round(core.config.plan.activation_peak / GiB, 3)
    if device.type == "cuda":
        res["device_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
    return res


def linear_flops_per_token(cfg: Any) -> float:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkvo = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2.0 * cfg.num_hidden_layers * (qkvo + 3 * h * inter)


def prefill_speed(core: Any, prompt_len: int, chunk: int, peak_tflops: float) -> dict:
    """A prompt_len prompt prefilled in chunks of `chunk` straight through the model runner, on a scratch
    KV pool so the engine's own (prefix-cached) blocks are never touched. Second pass is timed."""
    from ladle.runner.step_batch import StepBatch
    from ladle.runner.kv_allocation import allocate_kv_caches
    from ladle.runner.model_runner import ModelRunner
    from ladle.runner.sampling_batch import sampling_metadata
    from ladle.sampling_params import SamplingParams

    cfg, ec = core.hf_config, core.config
    layers, hd = cfg.num_hidden_layers, ec.kv_layout.groups[0].spec.head_dim
    blocks = -(-prompt_len // ec.block_size)
    runner = ModelRunner(core.model_executor.runner.model, allocate_kv_caches(ec.kv_layout, layers, blocks, ec.device),
                         ec.block_size, ec.device)
    ids, table = prompts(1, prompt_len, cfg.vocab_size, 7)[0], list(range(blocks))
    greedy = sampling_metadata([SamplingParams(temperature=0.0)], cfg.vocab_size, ec.device)
    empty = sampling_metadata([], cfg.vocab_size, ec.device)
    times = []
    for _ in range(2):
        sync(ec.device)
        t0 = time.perf_counter()
        for s in range(0, prompt_len, chunk):
            last = s + chunk >= prompt_len
            runner.run(StepBatch().add(ids[s : s + chunk], s, table, last), greedy if last else empty)
        sync(ec.device)
        times.append(time.perf_counter() - t0)
    attn = 4.0 * layers * cfg.num_attention_heads * hd * prompt_len * (prompt_len + 1) / 2
    flops = linear_flops_per_token(cfg) * prompt_len + attn
    return dict(prompt=prompt_len, chunk=chunk, tok_s=round(prompt_len / times[-1], 1),
                tflops=round(flops / times[-1] / 1e12, 1), mfu=round(flops / times[-1] / (peak_tflops * 1e12), 3),
                attention_flop_share=round(attn / flops, 3), cold_s=round(times[0], 2), warm_s=round(times[-1], 2))
