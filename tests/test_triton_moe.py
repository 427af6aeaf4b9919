"""The Triton fused-MoE path (expert-sorted blocks, two grouped GEMMs) against the torch experts of
ladle.models.layers.moe, in Triton's interpreter on CPU; and its kernel compiles for sm_90."""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")

from ladle.models.layers.moe import FusedMoE, route  # noqa: E402
from ladle.models.layers.ops import TorchOps  # noqa: E402
from ladle.kernels import triton_moe  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> FusedMoE:
    torch.manual_seed(seed)
    moe = FusedMoE(num_experts, hidden, inter, "silu")
    with torch.no_grad():
        moe.w13.normal_(0, 0.2)
        moe.w2.normal_(0, 0.2)
    return moe.to(DEVICE)


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 2, 8), (7, 2, 8), (33, 4, 16), (64, 1, 4)])
def test_alignment_places_every_pair_once_in_its_experts_blocks(tokens, top_k, num_experts):
    torch.manual_seed(tokens)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    sorted_ids, expert = triton_moe.moe_align_block_size(ids, 16, num_experts)
    pairs = tokens * top_k
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(expert.tolist()):
        rows = sorted_ids[b * 16 : (b + 1) * 16]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert bool((flat[rows.long()] == e).all())


@pytest.mark.parametrize("tokens,top_k,num_experts,hidden,inter", [(1, 2, 8, 32, 16), (9, 2, 8, 32, 16),
                                                                    (40, 4, 16, 48, 24), (17, 8, 8, 64, 32)])
def test_fused_experts_match_the_torch_experts(tokens, top_k, num_experts, hidden, inter):
    moe = _experts(num_experts, hidden, inter, seed=hidden + tokens)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g).to(DEVICE), top_k, True, torch.float32)
    want = moe(x, weights, ids)
    got = triton_moe.fused_experts(x, moe.w13.detach(), moe.w2.detach(), weights, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    # The worst routing: every token through the same experts (one block run per expert, many blocks).
    same = torch.arange(top_k, device=DEVICE).expand(tokens, top_k)
    assert torch.allclose(triton_moe.fused_experts(x, moe.w13.detach(), moe.w2.detach(), weights, same),
                          moe(x, weights, same), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_grouped_gemm_compiles_for_hopper():
    compile_for_sm90("""
from ladle.kernels.triton_moe import _grouped_gemm_kernel
base = {"weights": "*fp32", "sorted_ids": "*i32", "expert_ids": "*i32", "num_pairs": "i32", "N": "i32", "K": "i32",
        "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bk": "i32", "stride_se": "i32",
        "stride_sn": "i32", "stride_cm": "i32"}
# FORMAT 0: dense weights; 1: e4m3 bytes + fp32 block scales; 2: MXFP4 bytes + E8M0 scale bytes.
for fmt, b, scales in ((0, None, None), (1, "*u8", "*fp32"), (2, "*i8", "*u8")):
    for dtype in ("*bf16", "*fp16"):
        types = dict(base, a=dtype, b=b or dtype, s=scales or dtype, c=dtype)
        for scale in (False, True):
            build(_grouped_gemm_kernel, types, {"ROWS_PER_A": 2, "SCALE": scale, "FORMAT": fmt, "SCALE_N": 128,
                                                "SCALE_K": 128, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64},
                  num_warps=4)
print("compiled for sm_90")
""")


def test_a_moe_model_runs_the_triton_experts_end_to_end(tmp_path):
    """The whole Qwen3-MoE model with the CUDA code path's experts (interpreted here): same greedy tokens."""
    from ladle import LLM, SamplingParams
    from ladle.demo import build_checkpoint
    from ladle.models.layers.moe import FusedMoE as Experts
    from ladle.models.layers.ops import TritonOps

    path = build_checkpoint(tmp_path / "moe", "qwen3_moe", vocab_size=512, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
                            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=512, seed=6)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 20)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=32)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(path, max_num_batched_tokens=64, num_kv_blocks=32, enable_prefix_caching=False)
    experts = [m for m in llm.engine.core.model_executor.runner.model.modules() if isinstance(m, Experts)]
    for m in experts:
        m.ops = TritonOps()
    assert experts and [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want


def test_the_swiglu_clamp_matches_the_torch_experts():
    """DeepSeek-V4's experts clamp gate (above) and up (both ways) at swiglu_limit; weights large enough that
    the clamp bites."""
    moe = _experts(8, 32, 16, seed=3)
    with torch.no_grad():
        moe.w13.mul_(20)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 32, generator=g).to(DEVICE)
    weights, ids = route(torch.randn(12, 8, generator=g).to(DEVICE), 2, True, torch.float32)
    w13, w2 = moe.w13.detach(), moe.w2.detach()
    assert float(torch.einsum("th,eih->tei", x, w13).abs().max()) > 2.0  # pre-activations past the limit
    want = TorchOps.fused_experts(x, w13, w2, weights, ids, swiglu_limit=2.0)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids, swiglu_limit=2.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert not torch.allclose(want, TorchOps.fused_experts(x, w13, w2, weights, ids), atol=1e-3)
