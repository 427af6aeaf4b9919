"""Block-scaled FP8 checkpoints (Qwen3's release format), kept FP8 in memory: greedy tokens equal HF
transformers loading the same files dequantized, under chunked prefill and preemption; bad files fail at load
with the tensor named; the setting and the plan say what the weights are."""
from __future__ import annotations

import random

import pytest
import torch

from ladle.testing.fp8_checkpoints import hf_dequantized, quantize_block_fp8, write_fp8_checkpoint
from hf_oracle import assert_greedy_under_preemption, hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.demo import build_checkpoint
from ladle.kernels.cpu_isa import kernel_levels
from ladle.quantization.fp8_linear import Fp8ExpertStack, Fp8Linear, WidenBuffer

SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512)  # every projection a whole number of 128 x 128 blocks, as in the releases
NEW = 6


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory) -> str:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", **SHAPE, seed=1)


@pytest.fixture(scope="module")
def fp8(unquantized, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, HF's greedy tokens on the dequantized files)."""
    path = write_fp8_checkpoint(unquantized, tmp_path_factory.mktemp("qwen3_fp8"))
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (1, 7, 40, 130, 260)]
    hf = hf_dequantized(path)
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("budget,chunk", [(4096, None), (64, 19)])
def test_fp8_greedy_equals_hf_dequantized(fp8, budget, chunk):
    path, prompts, want = fp8
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=budget,
              **({"max_prefill_length": chunk} if chunk else {}))
    assert ladle_tokens(llm, prompts, GREEDY) == want
    layers = [m for m in llm.engine.core.model_executor.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 8 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)  # qkv, o, gate_up, down


def test_fp8_under_preemption(fp8):
    path, _, _ = fp8
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (30, 45, 60, 38, 52)]
    hf = hf_dequantized(path)
    assert_greedy_under_preemption(path, prompts, [hf_greedy(hf, p, 24) for p in prompts], 24, num_kv_blocks=12)


def test_the_weights_stay_fp8_and_the_plan_says_so(fp8, unquantized):
    path, _, _ = fp8
    q, full = LLM(path, num_kv_blocks=64), LLM(unquantized, num_kv_blocks=64)
    setting = q.engine.core.config.settings["quantization"]
    assert (setting.value, setting.source) == ("fp8", "derived")
    assert full.engine.core.config.settings["quantization"].value == "none"
    report = q.engine.core.config.report()
    assert "FP8 e4m3 + fp32 scales" in report and "in 8 layers" in report

    def weight_bytes(llm: LLM) -> int:
        return sum(t.numel() * t.element_size() for t in llm.engine.core.model_executor.runner.model.parameters())

    # The projections take a byte a weight (plus a scale per 16K weights) against fp32's four.
    assert weight_bytes(q) < 0.4 * weight_bytes(full)
    assert LLM(path, num_kv_blocks=64, quantization="fp8").engine.core.config.settings["quantization"].source == \
        "explicit"
    with pytest.raises(ValueError, match="checkpoint is unquantized"):
        LLM(unquantized, quantization="fp8")
    with pytest.raises(ValueError, match="online quantization"):
        LLM(unquantized, quantization="int4")


def _break(tmp_path, unquantized, edit, **config) -> str:
    return write_fp8_checkpoint(unquantized, tmp_path / "bad", edit=edit, **config)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.__setitem__(f"{Q}.weight_scale_inv", t[f"{Q}.weight_scale_inv"][:, :1].contiguous()),
     f"{Q}.weight_scale_inv: scale grid shape"),
    (lambda t: t.pop(f"{Q}.weight_scale_inv"), f"{Q}.weight is quantized but the checkpoint has no scale"),
    # E8M0 exponents (one byte a block) where the format stores fp32 scales: read as numbers they would be wrong.
    (lambda t: t.__setitem__(f"{Q}.weight_scale_inv", torch.full_like(t[f"{Q}.weight_scale_inv"], 120,
                                                                       dtype=torch.uint8)), "U8, but .* stores them as F32"),
    (lambda t: t[f"{Q}.weight_scale_inv"].view(-1)[0].fill_(float("nan")), f"{Q}.weight_scale_inv has scales that are not finite"),
    (lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", t["model.layers.1.mlp.up_proj.weight"].float()),
     "only .*gate_proj.* are quantized"),
])
def test_bad_fp8_files_fail_at_load_naming_the_tensor(tmp_path, unquantized, edit, message):
    path = _break(tmp_path, unquantized, edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, num_kv_blocks=16)


def test_fp8_values_without_a_quantization_config_are_refused(tmp_path, unquantized):
    import json
    from pathlib import Path

    path = write_fp8_checkpoint(unquantized, tmp_path / "q")
    config = json.loads((Path(path) / "config.json").read_text())
    del config["quantization_config"]
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="checkpoint dtype torch.float8_e4m3fn"):
        LLM(path, num_kv_blocks=16)


@pytest.mark.parametrize("field,value,message", [
    ("fmt", "e5m2", "only 'e4m3'"), ("activation_scheme", "static", "only 'dynamic'"),
    ("weight_block_size", None, "two positive ints"), ("kv_cache_scheme", "fp8", "does not implement"),
])
def test_quantization_config_fields_are_read_or_refused(tmp_path, unquantized, field, value, message):
    import json
    from pathlib import Path

    path = write_fp8_checkpoint(unquantized, tmp_path / "q")
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"][field] = value
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(path, num_kv_blocks=16)


@pytest.mark.parametrize("c_kernels", [False, True])
def test_ragged_blocks_dequantize_by_their_own_scales(monkeypatch, c_kernels):
    """Shapes off the block grid (an edge block smaller than 128 x 128; HF's dequantize assumes whole blocks):
    each entry is its value times its block's scale, in torch or ladle's C widening (bf16 rounded alike), and a
    forward tile by tile (tiles of 128 rows here) through F.linear or, bf16 rows, skinny_linear."""
    from ladle.kernels.cpu_kernels import load
    from ladle.quantization import fp8_linear

    monkeypatch.setattr(fp8_linear, "TILE_ELEMENTS", 300 * 128)
    torch.manual_seed(0)
    weight = torch.randn(1100, 300) * 0.05
    values, scales = quantize_block_fp8(weight, (128, 128))
    layer = Fp8Linear(300, 1100, bias=False, block=(128, 128))
    layer.weight.data.copy_(values)
    layer.weight_scale_inv.data.copy_(scales)
    if c_kernels:
        layer.use_cpu_kernels(load(), native_bf16=False)
    want = torch.empty(1100, 300)
    for i in range(1100):
        for j0 in range(0, 300, 128):
            want[i, j0 : j0 + 128] = values[i, j0 : j0 + 128].float() * scales[i // 128, j0 // 128]
    assert torch.equal(layer.dequantized(0, 1100, torch.float32), want)
    assert torch.equal(layer.dequantized(256, 1100, torch.bfloat16), want[256:].bfloat16())
    x = torch.randn(30, 300)
    if c_kernels:  # an expert's prefill product: widened once into the shared buffer, then one GEMM
        experts = Fp8ExpertStack(values[None], scales[None], (128, 128), torch.float32, layer.kernels, WidenBuffer())
        torch.testing.assert_close(experts.linear(x, 0), x @ want.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), x @ want.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.bfloat16()).float(), (x.bfloat16().float() @ want.bfloat16().float().T),
                               rtol=2e-2, atol=2e-2)
    assert (layer.dequantized(0, 1100, torch.float32) - weight).abs().max() < 0.02  # e4m3 keeps ~2 digits


def test_a_stacked_part_off_the_block_grid_is_refused():
    with pytest.raises(ValueError, match="off the 128-row block grid"):
        Fp8Linear(256, 256 + 64, bias=False, block=(128, 128), shards={"q_proj": (0, 192), "k_proj": (192, 128)})


MOE = dict(SHAPE, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


@pytest.mark.parametrize("expert_dtype,fmt,values", [("fp8", "fp8", torch.float8_e4m3fn), ("fp4", "mxfp4", torch.int8)])
def test_fp8_experts_give_hf_dequantized_tokens(tmp_path, expert_dtype, fmt, values):
    """Qwen3-MoE's FP8 release layout: every expert's gate/up/down and the attention FP8, the router not;
    the experts stay FP8, each routed one dequantized when a step reaches it. And the same with the experts
    MXFP4 (expert_dtype fp4, as DeepSeek-V4 ships its own), read in C for decode rows."""
    path = write_fp8_checkpoint(build_checkpoint(tmp_path / "moe", "qwen3_moe", **MOE, seed=2), tmp_path / "q",
                                expert_dtype=expert_dtype)
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 50, 140)]
    hf = hf_dequantized(path)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    llm = LLM(path, num_kv_blocks=128, max_num_batched_tokens=64, max_prefill_length=19)
    assert ladle_tokens(llm, prompts, GREEDY) == want
    experts = [m for m in llm.engine.core.model_executor.runner.model.modules() if hasattr(m, "weight_format")]
    assert experts and all((m.weight_format, m.w13.dtype) == (fmt, values) for m in experts)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
@pytest.mark.parametrize("out_features,in_features,rows", [(1100, 304, 3), (256, 256, 1), (200, 136, 1), (520, 260, 5),
                                                           (384, 1024, 24)])
def test_the_c_kernel_reads_fp8_bytes_as_the_dequantized_weight(out_features, in_features, rows, level):
    """ladle's fp8_linear (decode rows) against F.linear on the dequantized weight, at every instruction-set level
    this CPU runs: ragged blocks, widths off the AVX-512 (136) and AVX2 (260: the scalar path) vector sizes,
    subnormal and negative-zero bytes, a bias."""
    from ladle.kernels.cpu_kernels import load

    kernels = load(level)
    torch.manual_seed(out_features)
    values, scales = quantize_block_fp8(torch.randn(out_features, in_features) * 0.05, (128, 128))
    values.view(torch.uint8).view(-1)[:16] = torch.arange(16, dtype=torch.uint8) | 0x80  # -0 and subnormals
    values.view(torch.uint8).view(-1)[16:24] = torch.arange(8, dtype=torch.uint8)
    layer = Fp8Linear(in_features, out_features, bias=True, block=(128, 128))
    layer.weight.data.copy_(values)
    layer.weight_scale_inv.data.copy_(scales)
    layer.bias.data.normal_()
    x = torch.randn(rows, in_features)
    want = torch.nn.functional.linear(x, layer.dequantized(0, out_features, torch.float32), layer.bias)
    layer.use_cpu_kernels(kernels, native_bf16=True)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
@pytest.mark.parametrize("magnitude", [1e3, 1e30])
def test_the_c_kernel_keeps_large_activations_finite_and_exact(magnitude, level):
    """The kernel scales x by 2^e to skip a per-weight multiply; activations too large for 2^120 take a smaller e
    and still give F.linear's result, batch 1 and batched."""
    from ladle.kernels.cpu_kernels import load

    torch.manual_seed(0)
    values, scales = quantize_block_fp8(torch.randn(256, 512) * 0.05, (128, 128))
    layer = Fp8Linear(512, 256, bias=False, block=(128, 128))
    layer.weight.data.copy_(values)
    layer.weight_scale_inv.data.copy_(scales)
    want_weight = layer.dequantized(0, 256, torch.float32)
    layer.use_cpu_kernels(load(level), native_bf16=True)
    for rows in (1, 3):
        x = torch.randn(rows, 512) * magnitude
        want = torch.nn.functional.linear(x, want_weight)
        got = layer(x)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * magnitude)


@pytest.mark.slow
def test_fp8_at_tensor_parallel_size_2_equals_hf(tmp_path):
    """Each rank loads its slice of every FP8 weight and the matching rows or columns of its scale grid: q/k/v
    and gate/up by rows, o/down by columns, and the experts on their intermediate dimension. Head size 128, as
    in the releases, so each rank's share of every projection is whole blocks."""
    wide = SHAPE | {"head_dim": 128}
    path = write_fp8_checkpoint(build_checkpoint(tmp_path / "dense", "qwen3", **wide, seed=1), tmp_path / "dense_fp8")
    rng = random.Random(4)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (5, 90)]
    hf = hf_dequantized(path)
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=256) as llm:
        assert ladle_tokens(llm, prompts, GREEDY) == [hf_greedy(hf, p, NEW) for p in prompts]
    moe = write_fp8_checkpoint(build_checkpoint(tmp_path / "moe", "qwen3_moe", **(MOE | wide | {
        "moe_intermediate_size": 256}), seed=2), tmp_path / "moe_fp8")
    hf = hf_dequantized(moe)
    with LLM(moe, tensor_parallel_size=2, num_kv_blocks=128) as llm:
        assert ladle_tokens(llm, prompts, GREEDY) == [hf_greedy(hf, p, NEW) for p in prompts]


def test_a_tensor_parallel_share_off_the_block_grid_is_refused(fp8):
    """At TP 4 each rank's q rows are 64 of a 128-row block, its k rows start mid-block: refused."""
    from ladle.distributed.parallel_state import TensorParallel
    from ladle.models.loading.loader import load_model

    with pytest.raises(ValueError, match="off the 128-(row|wide) (FP8 )?block grid"):
        load_model(fp8[0], torch.device("cpu"), torch.float32, tp=TensorParallel(0, 4))


def test_scale_slices_follow_the_weight_slices():
    from ladle.models.loading.tensor_parallel import Slice
    from ladle.quantization.apply import with_scale_slices

    dtypes = {"o.weight": "F8_E4M3", "o.weight_scale_inv": "F32", "b.weight": "BF16"}
    got = with_scale_slices({"o.weight": Slice(1, 256, 256), "b.weight": Slice(0, 0, 64), "o.bias": None},
                            (128, 128), dtypes)
    assert got["o.weight_scale_inv"] == Slice(1, 2, 2) and "b.weight_scale_inv" not in got
    with pytest.raises(ValueError, match=r"o.weight: this rank's part \[64, 128\) is off the 128-wide"):
        with_scale_slices({"o.weight": Slice(1, 64, 64)}, (128, 128), dtypes)
