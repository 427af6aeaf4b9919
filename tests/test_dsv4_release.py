"""DeepSeek-V4 from its release files (FP8 e4m3 linears with E8M0 block scales, MXFP4 routed experts), kept
quantized in memory: greedy tokens equal HF transformers loading the same files dequantized, with every
layer type (sliding-window, compressed-sparse, heavily-compressed; hash and scored MoE), under chunked prefill
and preemption; bad files fail at load with the tensor named; the plan says what the weights are."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_oracle import assert_greedy_under_preemption, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.kernels.cpu_isa import kernel_levels
from ladle.testing.fp8_checkpoints import hf_dequantized, write_dsv4_release_checkpoint
from test_deepseek_v4 import CSA, HCA, SW, build, hf_greedy, prompts_of

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# Wide enough for two 128 x 128 FP8 blocks across the hidden size and several MXFP4 groups per row.
SHAPE = dict(layer_types=[SW, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8,
             index_topk=3, hidden_size=256, moe_intermediate_size=64, q_lora_rank=128, head_dim=64,
             o_lora_rank=32)


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dsv4")
    build(path, 0, **SHAPE)
    return str(path)


@pytest.fixture(scope="module")
def release(unquantized, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, HF's greedy tokens on the dequantized files)."""
    path = write_dsv4_release_checkpoint(unquantized, tmp_path_factory.mktemp("dsv4_release"))
    prompts = prompts_of([1, 9, 40, 130], 3)
    hf = hf_dequantized(path)
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


@pytest.mark.parametrize("budget,chunk", [(4096, None), (7, 5), (64, 19)])
def test_release_files_give_hf_dequantized_tokens(release, budget, chunk):
    path, prompts, want = release
    llm = LLM(path, dtype="float32", max_num_batched_tokens=budget,
              **({"long_prefill_token_threshold": chunk} if chunk else {}))
    assert ladle_tokens(llm, prompts, GREEDY) == want


@pytest.mark.slow
def test_release_files_under_preemption(release):
    path, _, _ = release
    prompts = prompts_of([30] * 6, 12)
    hf = hf_dequantized(path)
    # As test_deepseek_v4's: the compressed layers' entries outgrow what admission reserved.
    assert_greedy_under_preemption(path, prompts, [hf_greedy(hf, p, 60) for p in prompts], 60, num_kv_blocks=10)


def test_quantization_changes_the_tokens(release, unquantized):
    """The oracle is sensitive to the format: the unquantized weights give other tokens (a wrong scale or nibble
    order in ladle could not hide behind weights too small to matter)."""
    path, prompts, want = release
    assert ladle_tokens(LLM(unquantized, dtype="float32"), prompts, GREEDY) != want


def test_the_weights_stay_quantized_and_the_plan_says_so(release, unquantized):
    path, _, _ = release
    llm = LLM(path, dtype="float32")
    model = llm.engine.core.model_executor.runner.model
    experts = model.layers[1].ffn.experts
    assert (experts.weight_format, experts.w13.dtype, experts.w13_scale_inv.dtype) == (
        "mxfp4", torch.int8, torch.float8_e8m0fnu)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].attn.wq_a.weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert model.layers[1].attn.compressor.wkv.weight.dtype == torch.float32  # bf16 in the files, not quantized
    report = llm.engine.core.config.report()
    assert "FP8 e4m3 + E8M0 scales" in report and "MXFP4 + E8M0 scales" in report and "in 3 layers" in report
    assert "routed experts MXFP4" in report  # the quantization setting's provenance

    def weight_bytes(llm: LLM) -> int:
        return sum(t.numel() * t.element_size() for t in llm.engine.core.model_executor.runner.model.parameters())

    assert weight_bytes(llm) < 0.5 * weight_bytes(LLM(unquantized, dtype="float32"))


W1 = "layers.1.ffn.experts.2.w1"
WQ = "layers.0.attn.wq_a"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__(f"{W1}.scale", t[f"{W1}.scale"][:, :4].contiguous()), "scale grid shape"),
    (lambda t: t.pop(f"{WQ}.scale"), f"{WQ}.weight is quantized but the checkpoint has no scale"),
    # The E8M0 bytes' values written as fp32 numbers: read as the format says, each would be wrong.
    (lambda t: t.__setitem__(f"{WQ}.scale", t[f"{WQ}.scale"].float()), f"{WQ}'s scales are F32, but .* F8_E8M0"),
    (lambda t: t[f"{W1}.scale"].view(torch.uint8).view(-1)[0].fill_(255), "not finite"),  # 0xFF is E8M0's NaN
    (lambda t: t.__setitem__(f"{W1}.weight", torch.zeros(64, 256, dtype=torch.float8_e4m3fn)),
     f"{W1}.weight is F8_E4M3, but .* MXFP4"),
])
def test_bad_release_files_fail_at_load_naming_the_tensor(tmp_path, unquantized, edit, message):
    path = write_dsv4_release_checkpoint(unquantized, tmp_path / "bad", edit=edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32")


@pytest.mark.parametrize("where,field,value,message", [
    ("quantization_config", "scale_fmt", "e4m3", "scale_fmt 'e4m3' is not supported"),
    (None, "expert_dtype", "int4", "expert_dtype 'int4' is not supported"),
])
def test_release_config_fields_are_read_or_refused(tmp_path, unquantized, where, field, value, message):
    path = Path(write_dsv4_release_checkpoint(unquantized, tmp_path / "q"))
    config = json.loads((path / "config.json").read_text())
    (config if where is None else config[where])[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32")


def test_dequantize_weights_widens_at_load_and_gives_the_same_tokens(release, unquantized):
    path, prompts, want = release
    llm = LLM(path, dtype="float32", dequantize_weights=True)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    model = llm.engine.core.model_executor.runner.model
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float32}
    assert model.layers[1].ffn.experts.weight_format is None
    setting = llm.engine.core.config.settings["dequantize_weights"]
    assert (setting.value, setting.source) == (True, "explicit")
    assert "FP8 e4m3" not in llm.engine.core.config.report().split("weights", 1)[1].splitlines()[0]
    kept = LLM(path, dtype="float32").engine.core.config.settings["dequantize_weights"]
    assert (kept.value, kept.source, kept.reason) == (False, "derived", "the checkpoint's quantized weights stay quantized")
    with pytest.raises(ValueError, match="checkpoint is unquantized: nothing to widen"):
        LLM(unquantized, dtype="float32", dequantize_weights=True)


@pytest.mark.parametrize("rows,k,n", [(1, 256, 64), (3, 64, 256), (24, 96, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
def test_the_c_kernel_reads_mxfp4_bytes_as_the_dequantized_weight(rows, k, n, dtype, level):
    """ladle's mxfp4_linear (an expert's decode rows) against F.linear on the widened weight, at every
    instruction-set level this CPU runs: every nibble (both signs of zero), scales from 2^-127 (E8M0's 0) to 2^8,
    partial 4-row tiles."""
    from ladle.kernels.cpu_kernels import load
    from ladle.quantization.fp8_linear import WidenBuffer
    from ladle.quantization.mxfp4 import Mxfp4ExpertStack

    torch.manual_seed(rows * k)
    packed = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8).view(torch.int8)
    packed.view(torch.uint8)[0, 0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    scales = torch.randint(110, 135, (2, n, k // 32), dtype=torch.uint8)
    scales[0, 0, 0], scales[0, 1, 0] = 0, 135
    scales = scales.view(torch.float8_e8m0fnu)
    x = torch.randn(rows, k).to(dtype)
    stack = Mxfp4ExpertStack(packed, scales, dtype, load(level), WidenBuffer())
    for expert in range(2):  # a prefill's widening in C: the same bits as torch's, and its product
        assert torch.equal(stack.widened(expert, dtype), stack[expert])
        many = torch.randn(30, k).to(dtype)
        torch.testing.assert_close(stack.linear(many, expert), torch.nn.functional.linear(many, stack[expert]))
    for expert in range(2):
        want = torch.nn.functional.linear(x.float(), stack[expert].float())
        got = stack.linear(x, expert).float()
        assert got.shape == (rows, n)
        torch.testing.assert_close(got, want.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-30 + (want.abs().max().item() * (1e-2 if dtype == torch.bfloat16 else 1e-5)))
