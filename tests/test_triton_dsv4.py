"""DeepSeek-V4's attention kernel (window from the paged pool, compressed entries by pool row, sinks) in
Triton's interpreter on CPU, in a whole model whose greedy tokens must equal the torch reference path's. (The
fused-MoE kernel's SwiGLU clamp is tested in test_triton_moe.py.)"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated

pytest.importorskip("triton", reason="triton is not installed (the 'test' extra installs it)")

from hf_oracle import ladle_tokens  # noqa: E402
from ladle import LLM, SamplingParams  # noqa: E402
from ladle.attention.triton_backend import TritonAttention  # noqa: E402
from sm90 import compile_for_sm90  # noqa: E402
from test_deepseek_v4 import CSA, HCA, SW, build, prompts_of  # noqa: E402


@pytest.mark.slow
def test_a_deepseek_v4_model_on_the_triton_path_gives_the_reference_tokens(tmp_path):
    """Every layer kind, a window smaller than a block, top-k below the entries of the longer prompts, chunked
    prefill (budget 32, cap 13) and decodes: the same greedy tokens as the torch path (which equals HF)."""
    build(tmp_path, 4, layer_types=[SW, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8,
          index_topk=3, hidden_size=32, num_attention_heads=2, q_lora_rank=32, o_groups=1)
    prompts = prompts_of([1, 9, 50], 6)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=32, max_prefill_length=13)
    want = ladle_tokens(llm, prompts, params)
    runner = llm.engine.core.model_executor.runner
    runner.groups = tuple(replace(g, backend=TritonAttention()) for g in runner.groups)
    assert ladle_tokens(llm, prompts, params) == want


@pytest.mark.slow
def test_the_attention_kernel_compiles_for_hopper():
    """Flash's shape (512 head dims) in bf16 and fp32: the interpreter cannot catch what ptxas does."""
    compile_for_sm90("""
from ladle.attention.triton_dsv4 import _dsv4_attention_kernel
for dtype in ("*bf16", "*fp32"):
    types = {"q_ptr": dtype, "pool_ptr": dtype, "ent_ptr": dtype, "table_ptr": "*i32", "req_ptr": "*i64",
             "pos_ptr": "*i64", "extra_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": dtype, "stride_qt": "i32",
             "stride_qh": "i32", "stride_table": "i32", "stride_extra": "i32", "stride_ot": "i32",
             "stride_oh": "i32", "num_extra": "i32", "scale": "fp32", "window": "i32", "num_heads": "i32"}
    build(_dsv4_attention_kernel, types, {"HEAD_DIM": 512, "BLOCK_D": 512, "BLOCK_H": 16, "BLOCK_N": 32,
                                          "BLOCK_SIZE": 16, "PRECISION": "ieee" if dtype == "*fp32" else "tf32"},
          num_warps=8)
print("compiled for sm_90")
""")
