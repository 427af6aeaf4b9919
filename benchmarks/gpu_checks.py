"""Correctness sections of the device run (benchmarks/gpu_h200.py): the fused Triton ops against the torch
reference, and the whole CUDA engine (Triton attention and ops, fused projections, CUDA graphs, chunked
prefill) against HF transformers, token for token, in fp32 on the GPU."""
from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import torch

from ladle.demo import build_checkpoint, demo_model_kwargs


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    got, want = got.cpu(), want.cpu()
    return dict(max_abs_err=float((got.float() - want.float()).abs().max()) if got.numel() else 0.0,
                bitwise_equal=round(float((got == want).float().mean()), 5))


def ops_check(device: torch.device, small: bool) -> dict[str, Any]:
    """Each fused op on the device against the torch ops it replaces, run on CPU copies of the same bf16
    inputs (the HF-exact reference path); at the 8B shapes unless small."""
    from ladle.models.layers.decoder_layer import RMSNorm
    from ladle.models.layers.ops import apply_rotary
    from ladle.kernels import triton_ops

    hidden, inter, hq, hk, d = (64, 128, 8, 2, 16) if small else (4096, 12288, 32, 8, 128)
    t, dtype, eps = 37, torch.bfloat16, 1e-6
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    x, res, w = rand(t, hidden), rand(t, hidden), (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    norm = RMSNorm(hidden, eps).to(dtype)
    norm.weight.data.copy_(w)
    dev = {name: v.to(device) for name, v in (("x", x), ("res", res), ("w", w))}
    out: dict[str, Any] = {}
    with torch.inference_mode():
        out["rms_norm"] = _compare(triton_ops.rms_norm(dev["x"], dev["w"], eps), norm(x))
        normed, total = triton_ops.fused_add_rms_norm(dev["x"], dev["res"], dev["w"], eps)
        out["fused_add_rms_norm"] = _compare(normed, norm(x + res))
        out["fused_add_residual"] = _compare(total, x + res)
        gate_up = rand(t, 2 * inter)
        gate, up = gate_up.chunk(2, dim=-1)
        out["silu_and_mul"] = _compare(triton_ops.silu_and_mul(gate_up.to(device)),
                                       torch.nn.functional.silu(gate) * up)
        qkv = rand(t, (hq + 2 * hk) * d)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.view(t, hq, d), k.view(t, hk, d)
        qn, kn = RMSNorm(d, eps).to(dtype), RMSNorm(d, eps).to(dtype)
        qn.weight.data.copy_(rand(d)), kn.weight.data.copy_(rand(d))
        pos = torch.arange(t, dtype=torch.float32)[:, None] * (1e6 ** (-torch.arange(0, d, 2) / d))[None, :]
        emb = torch.cat((pos, pos), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        dq, dk, _ = qkv.to(device).split([hq * d, hk * d, hk * d], dim=-1)
        got_q, got_k = triton_ops.qk_norm_rope(dq.view(t, hq, d), dk.view(t, hk, d), qn.weight.to(device),
                                               kn.weight.to(device), cos.to(device), sin.to(device), eps)
        out["qk_norm_rope_q"] = _compare(got_q, apply_rotary(qn(q), cos, sin))
        out["qk_norm_rope_k"] = _compare(got_k, apply_rotary(kn(k), cos, sin))
        out["fused_experts"] = _experts_check(device, small, rand)
    out["ok"] = all(v["bitwise_equal"] >= 0.99 for v in out.values() if isinstance(v, dict) and "close" not in v)
    out["ok"] = out["ok"] and out["fused_experts"]["close"]
    return out


def _experts_check(device: torch.device, small: bool, rand: Any) -> dict[str, Any]:
    """The Triton grouped-GEMM experts against the torch ones at a Qwen3-30B-A3B layer's shape (128 experts
    of 768, top 8), bf16: close, not bitwise (the k slots of a token are summed in another order)."""
    from ladle.models.layers.moe import route
    from ladle.models.layers.ops import TorchOps, TritonOps

    experts, inter, hidden, top_k, t = (8, 32, 64, 2, 37) if small else (128, 768, 2048, 8, 256)
    w13, w2, x = rand(experts, 2 * inter, hidden) * 0.05, rand(experts, hidden, inter) * 0.05, rand(t, hidden)
    weights, ids = route(rand(t, experts).float(), top_k, True, torch.bfloat16)
    want = TorchOps.fused_experts(x, w13, w2, weights, ids)
    got = TritonOps.fused_experts(*(v.to(device) for v in (x, w13, w2, weights, ids)))
    res = _compare(got, want)
    res["close"] = bool(torch.allclose(got.cpu().float(), want.float(), atol=2e-2, rtol=5e-2))
    return res


def _greedy_tokens(core: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    from ladle.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"check{i}", p, params))
        tokens[f"check{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    return [tokens[f"check{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def _hf_greedy(model: Any, prompt: list[int], new: int, device: torch.device) -> list[int]:
    """HF's forward over its own cache, argmax each step: generate() with min_new_tokens would mask EOS, which
    ladle's ignore_eos does not (tests/hf_oracle.py is the same loop)."""
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens: list[int] = []
    while len(tokens) < new:
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


def engine_vs_hf(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    """The demo-model shape (fp32, peaked random weights), a Mistral of the same shape with a 48-token sliding
    window, a Qwen3.5 hybrid (Gated DeltaNet: flash-linear-attention's kernel when it is importable, the
    torch reference otherwise; `fla` in the result says which) and a DeepSeek-V4 (its Triton attention
    kernel and the clamped fused MoE) through the CUDA engine with CUDA graphs (not for the hybrid and
    DeepSeek-V4, whose state layers derive them off), a 128-token step budget (so prompts prefill in
    chunks beside decodes) and the eager engine, against HF's greedy loop; then prompts sharing the longest
    prompt's head, one after another with prefix caching (the state models resume from state checkpoints)."""
    from ladle.models.layers.ops import TritonOps

    hybrid = dict(arch="qwen3_5", layer_types=["linear_attention", "linear_attention", "linear_attention",
                                               "full_attention"],
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                  linear_value_head_dim=32)
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    dsv4 = dict(arch="deepseek_v4", num_key_value_heads=1, layer_types=["sliding_attention", csa, hca, csa],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=48,
                compress_rates={csa: 4, hca: 16}, index_topk=8, q_lora_rank=64, o_groups=2, o_lora_rank=64,
                index_n_heads=8, index_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, hc_mult=2,
                tie_word_embeddings=False)
    models = {"demo": demo_model_kwargs(),
              "mistral_window48": demo_model_kwargs() | dict(arch="mistral", sliding_window=48),
              "qwen3_5_hybrid": demo_model_kwargs() | hybrid,
              "deepseek_v4": demo_model_kwargs() | dsv4}
    res = {name: _model_vs_hf(device, workdir / f"check-{name}", kwargs, small,
                              graphs=name not in ("qwen3_5_hybrid", "deepseek_v4"))
           for name, kwargs in models.items()}
    return res | {"ok": all(r["ok"] for r in res.values()), "fla": TritonOps().has_fla}


def _model_vs_hf(device: torch.device, path: Path, model_kwargs: dict[str, Any], small: bool,
                 graphs: bool = True) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ladle.config.engine_args import EngineArgs
    from ladle.engine.core import EngineCore

    build_checkpoint(path, **model_kwargs)
    rng = random.Random(0)
    lengths, new = ((5, 37, 60), 6) if small else ((5, 37, 150, 300, 700), 24)
    prompts = [[rng.randrange(8000) for _ in range(n)] for n in lengths]
    if device.type != "cuda":
        from ladle.testing.hf_reference import use_torch_kernels

        use_torch_kernels()  # fla's kernels, if importable, cannot run on a CPU
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    want = [_hf_greedy(hf, p, new, device) for p in prompts]
    # Prefix hits: prompts sharing the longest prompt's head, each run after the ones before it (state models
    # resume from state checkpoints).
    longest = prompts[-1]
    shared = [longest[:k] + [rng.randrange(8000) for _ in range(9)] for k in (len(longest) - 1, len(longest) // 2)]
    want_shared = [_hf_greedy(hf, p, new, device) for p in shared]
    del hf
    res: dict[str, Any] = {"prompts": list(lengths), "new_tokens": new}
    # The dry run's engines hold a context of 512 (its prompts and their tokens fit in 75): start-up profiles the
    # activations up to the context, which at the model's 8192 took most of the dry run's time.
    context = dict(max_model_len=512) if small else {}
    # Graphs for decode-only steps and for steps with a prefill chunk of up to 64 tokens (the 37-token prompt
    # beside decodes), then decode-only graphs alone, then none.
    variants = {"graphs": dict(max_cudagraph_capture_size=64),
                "decode_graphs": dict(max_cudagraph_capture_size=8, cudagraph_mode="FULL_DECODE_ONLY"),
                "eager": dict(enforce_eager=True)}
    if device.type != "cuda" or not graphs:
        variants = {"eager": {}}
    for name, extra in variants.items():
        args, explicit = EngineArgs.from_kwargs(model=str(path), device=str(device), dtype="float32",
                                                max_num_batched_tokens=128, kv_cache_memory_bytes="1GiB", **extra,
                                                **context)
        core = EngineCore(args, explicit)
        got = _greedy_tokens(core, prompts, new)
        agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        res[name] = dict(matching_prefix=agree, identical=got == want)
        del core
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next engine measures free memory for its budget
    args, explicit = EngineArgs.from_kwargs(model=str(path), device=str(device), dtype="float32",
                                            max_num_batched_tokens=128, kv_cache_memory_bytes="1GiB", **context)
    core = EngineCore(args, explicit)
    got = [_greedy_tokens(core, [p], new)[0] for p in [longest, *shared]]
    res["prefix_hits"] = dict(identical=got == [want[-1], *want_shared], hit_tokens=core.stats.prefix_cache_hits,
                              checkpoints=core.stats.state_checkpoints_stored)
    del core
    res["ok"] = all(v["identical"] for v in res.values() if isinstance(v, dict)) and res["prefix_hits"]["hit_tokens"] > 0
    return res
