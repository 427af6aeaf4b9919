"""The device run's speculative-decoding section: n-gram drafts on a model that copies its prompt and MTP drafts on
DeepSeek-V4 whose MTP layer predicts it (benchmarks/spec_decode.py's and spec_decode_mtp.py's constructions),
through the CUDA engine, where a step carrying drafts replays MixedGraphs on graph-capable models.

Per case, in fp32 with drafts forced on every step: whether the greedy tokens with drafts equal the plain run's
(`tokens_identical`, the check of verification on the device's kernels). Then in the default dtype (bf16 on CUDA):
batch-1 decode tok/s with drafts over without (`speedup`, median of alternating turns after a warm-up that lets
the step arms settle; the plain side is the same engine with its speculator and MTP drafter detached), and the
share of drafts accepted. The bf16 tokens are reported (`bf16_tokens_identical`), not asserted: a verify step and a
decode step reduce in different orders, so a rounding tie may part them."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from ladle.demo import build_checkpoint

# The copying model: Mistral with a 16-token window, so it sees only the last layers x 16 tokens, and a repeated
# span of its own greedy text longer than that makes it continue that text, which prompt lookup proposes.
COPY = dict(arch="mistral", vocab_size=11000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, head_dim=64, intermediate_size=2048, sliding_window=16, tie_word_embeddings=True)
COPY_SMALL = dict(COPY, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128)
# DeepSeek-V4 (CSA, HCA and sliding layers, MoE, hyper-connections) with an MTP layer. Not Qwen3.5: on CUDA its Gated
# DeltaNet kernel keeps no state per draft, so the engine refuses speculative decoding on it there.
_SW, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MTP = dict(arch="deepseek_v4", vocab_size=11000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=1, head_dim=128, intermediate_size=384, q_lora_rank=256, n_routed_experts=16,
           num_experts_per_tok=4, o_groups=4, o_lora_rank=128, index_n_heads=8, index_head_dim=64, index_topk=64,
           sliding_window=128, hc_mult=4, layer_types=[_CSA, _HCA, _SW, _CSA],
           mlp_layer_types=["hash_moe", "moe", "moe", "moe"], tie_word_embeddings=False)
MTP_SMALL = dict(MTP, vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, head_dim=64,
                 intermediate_size=128, q_lora_rank=64, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
                 o_lora_rank=32, index_n_heads=4, index_head_dim=32, hc_mult=2, layer_types=[_SW, _CSA, _HCA],
                 mlp_layer_types=["hash_moe", "moe", "moe"])
NOISE = 0.006  # spec_decode_mtp.py's --dsv4-noise


def _checkpoint(workdir: Path, name: str, shape: dict[str, Any], mtp: bool) -> str:
    from ladle.testing.mtp_checkpoint import add_mtp_layer, make_predictable

    spec = dict(shape)
    path = build_checkpoint(workdir / name, spec.pop("arch"), seed=0, max_position_embeddings=4096, **spec)
    if mtp:
        add_mtp_layer(str(path), seed=1)
        make_predictable(str(path), NOISE, seed=2)
    return str(path)


def _engine(path: str, device: torch.device, dtype: str, spec: dict[str, Any], graphs: bool) -> Any:
    """graphs: capture fewer sizes than the default, to start faster (a state model runs eagerly, and refuses
    the setting)."""
    from ladle import LLM

    capture = dict(max_cudagraph_capture_size=64) if graphs and device.type == "cuda" else {}
    return LLM(path, device=str(device), dtype=dtype, max_model_len=2048, max_num_seqs=4,
               speculative_config=spec, **capture)


def _copy_prompts(llm: Any, heads: list[list[int]], text: int, span: tuple[int, int], tag: str) -> list[list[int]]:
    """head + the engine's own greedy text + a span of that text again (spec_decode.py's copy workload)."""
    from spec_decode_mtp import decode_run

    texts = [h + o for h, o in zip(heads, decode_run(llm, heads, text, tag, False)["outputs"])]
    return [t + t[span[0]: span[1]] for t in texts]


def _exactness(llm: Any, batch: list[list[int]], tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Greedy tokens with a draft at every step against the same engine's plain run."""
    from spec_decode_mtp import decode_run, force_drafts

    plain = decode_run(llm, batch, tokens, "eq-plain", False)
    drafted = decode_run(force_drafts(llm), batch, tokens, "eq-drafts", True)
    return dict(tokens_identical=plain["outputs"] == drafted["outputs"], forced_drafted=drafted["drafted"],
                forced_accepted=drafted["accepted"])


def _speed(llm: Any, batch: list[list[int]], tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Decode tok/s with drafts over without, in alternating turns after a warm-up with drafts."""
    from spec_decode_mtp import decode_run

    decode_run(llm, batch, warmup, "warm", True)
    turns: dict[bool, list[dict]] = {False: [], True: []}
    for turn in range(repeats):
        for with_drafts in (False, True) if turn % 2 == 0 else (True, False):
            turns[with_drafts].append(decode_run(llm, batch, tokens, f"t{turn}{with_drafts}", with_drafts))
    fast, slow = turns[True], turns[False]
    drafted, accepted = sum(r["drafted"] for r in fast), sum(r["accepted"] for r in fast)
    return dict(dtype=str(llm.engine.core.config.dtype).removeprefix("torch."),
                plain_tok_s=round(statistics.median(r["tok_s"] for r in slow), 1),
                spec_tok_s=round(statistics.median(r["tok_s"] for r in fast), 1),
                speedup=round(statistics.median(f["tok_s"] / p["tok_s"] for p, f in zip(slow, fast)), 3),
                drafted=drafted, acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
                bf16_tokens_identical=all(p["outputs"] == f["outputs"] for p, f in zip(slow, fast)))


def _case(path: str, device: torch.device, spec: dict[str, Any], prompts: Any, tokens: int, warmup: int,
          repeats: int, graphs: bool) -> dict[str, Any]:
    """prompts: the prompt list, or a function of the engine that makes it (the copy workload's)."""
    res: dict[str, Any] = {}
    for dtype, measure in (("float32", _exactness), ("auto", _speed)):
        llm = _engine(path, device, dtype, spec, graphs)
        res.update(measure(llm, prompts(llm) if callable(prompts) else prompts, tokens, warmup, repeats))
        llm.shutdown()
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res["ok"] = res["tokens_identical"] and res["forced_accepted"] > 0
    return res


def spec_decode_check(device: torch.device, workdir: Path, small: bool) -> dict[str, Any]:
    import random

    rng = random.Random(0)
    copy_shape, mtp_shape = (COPY_SMALL, MTP_SMALL) if small else (COPY, MTP)
    head, text, span = (8, 96, (16, 80)) if small else (32, 400, (40, 296))
    tokens, warmup, repeats = (16, 16, 2) if small else (128, 384, 3)
    heads = [[rng.randrange(copy_shape["vocab_size"]) for _ in range(head)]]
    ngram = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    out = {"ngram_copy_k5": _case(_checkpoint(workdir, "spec_copy", copy_shape, False), device, ngram,
                                  lambda llm: _copy_prompts(llm, heads, text, span, "copy"), tokens, warmup, repeats,
                                  graphs=True)}
    prompt = [[rng.randrange(mtp_shape["vocab_size"]) for _ in range(64 if small else 256)]]
    out["mtp_dsv4_k3"] = _case(_checkpoint(workdir, "spec_mtp", mtp_shape, True), device,
                               {"method": "mtp", "num_speculative_tokens": 3}, prompt, tokens, warmup, repeats,
                               graphs=False)
    out["ok"] = all(r["ok"] for r in out.values() if isinstance(r, dict))
    return out
