"""Qwen3.5 and Qwen3.5-MoE FP8 checkpoints: the full-attention q (with its gate), k, v, o, the Gated DeltaNet's
in_proj_qkv, in_proj_z and out_proj, the MLPs and the experts FP8 with fp32 block scales; in_proj_b and
in_proj_a (a row per value head) and the routers unquantized. Greedy tokens equal HF transformers loading the
same files dequantized, under chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from hf_oracle import assert_greedy_under_preemption, hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.quantization.fp8_linear import Fp8Linear
from ladle.testing.fp8_checkpoints import hf_dequantized, write_fp8_checkpoint
from test_qwen3_5 import _build, _prompts

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# Every quantized projection a whole number of 128-row blocks: q 2 x 4 x 64, k and v 2 x 64, the Gated
# DeltaNet's qkv 2 x 128 + 256 and z 256; hidden 256 is two blocks wide.
SHAPE = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], hidden_size=256,
             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
MIXES = {"dense": SHAPE, "moe": dict(SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                     shared_expert_intermediate_size=128)}


@pytest.fixture(scope="module", params=list(MIXES))
def case(request, tmp_path_factory):
    src = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    hf = _build(src, 11, **MIXES[request.param])
    path = write_fp8_checkpoint(src, tmp_path_factory.mktemp(f"qwen3_5_{request.param}_fp8"))
    prompts = _prompts([1, 23, 130], 3)
    oracle = hf_dequantized(path)
    unquantized = [hf_greedy(hf, p, NEW) for p in prompts]
    return path, oracle, prompts, [hf_greedy(oracle, p, NEW) for p in prompts], unquantized


@pytest.mark.parametrize("budget,chunk", [(4096, None), (7, 5)])
def test_fp8_greedy_equals_hf_dequantized(case, budget, chunk):
    path, _, prompts, want, unquantized = case
    assert want != unquantized  # the oracle sees the quantization: the test could catch a wrong scale
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=budget,
              **({"max_prefill_length": chunk} if chunk else {}))
    assert ladle_tokens(llm, prompts, GREEDY) == want
    model = llm.engine.core.model_executor.runner.model
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert {"in_proj_qkvz", "qkv_proj", "o_proj", "out_proj"} <= names and "in_proj_ba" not in names
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, Fp8Linear))


@pytest.mark.slow
def test_fp8_under_preemption(case):
    path, oracle, _, _, _ = case
    prompts = _prompts([40] * 6, 12)
    want = [hf_greedy(oracle, p, 24) for p in prompts]
    assert_greedy_under_preemption(path, prompts, want, max_tokens=24, num_kv_blocks=9)
