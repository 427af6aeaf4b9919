"""GGUF K-quants (issue 57 item 2): Q4_K, Q5_K and Q6_K linears stay in their 256-weight super-blocks on CPU.

ladle's C kernels and its torch fallback widen random super-blocks to exactly gguf's dequantize values, fp32
and bf16, with the AVX2 paths and the scalar ones; decode rows (ggml_linear) and prefill tiles match F.linear
on those weights; and a tiny llama file in K-quants (re-encoded from F32 as llama-quantize does) loads with its
decoder linears kept as blocks and gives transformers' gguf_file= greedy tokens under chunked prefill."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Where each type's fp16 scales sit in its super-block: d and dmin (Q4_K, Q5_K), d last (Q6_K).
_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the engine splits every long prompt into chunks.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
           "Hello, world! What is the capital of France?"]
MAX_TOKENS = 10


def random_blocks(rows: int, in_features: int, qtype: str, seed: int) -> np.ndarray:
    """[rows, row bytes] uint8 of random super-blocks: every quant and packed-scale bit pattern, with finite fp16
    scales of a trained model's size (random bytes there would give infinities and NaNs)."""
    from ladle.quantization.ggml_linear import BLOCK_TYPES

    rng = np.random.default_rng(seed)
    size, blocks = BLOCK_TYPES[qtype][1], in_features // 256
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in _HALVES[qtype]:
        scale = (rng.standard_normal((rows, blocks)) * 1e-3).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def kernel_builds() -> list[Any]:
    """ladle's C kernels as built for each instruction-set level this CPU runs (cpu_isa.kernel_levels: scalar,
    AVX2, AVX-512, AVX-512 BF16), so every path GgmlLinear calls runs here."""
    from ladle.kernels import cpu_kernels
    from ladle.kernels.cpu_isa import kernel_levels

    return [cpu_kernels.load(level) for level in kernel_levels()]


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quant_kernels_against_gguf_dequantize(kernel_builds: list[Any], qtype: str) -> None:
    """The torch fallback and ggml_dequantize (C, every level's build) widen to exactly gguf's dequantize
    values, fp32 and bf16; ggml_linear (the decode rows: 1..24) and the prefill tiles (40 rows, fp32, bf16 by
    skinny_linear and by F.linear) match F.linear over them, with a bias, to fp32 reordering."""
    import gguf
    from gguf.quants import dequantize

    from ladle.quantization.fp8_linear import KERNEL_MAX_ROWS, WidenBuffer
    from ladle.quantization.ggml_linear import GgmlLinear, torch_dequantize

    out_features, in_features = 72, 512  # two super-blocks a row
    raw = random_blocks(out_features, in_features, qtype, seed=K_QUANTS.index(qtype))
    exact = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))
    assert torch.isfinite(exact).all() and exact.abs().max() > 0
    layer = GgmlLinear(in_features, out_features, bias=True, qtype=qtype)
    layer.weight.data.copy_(torch.from_numpy(raw))
    g = torch.Generator().manual_seed(0)
    layer.bias.data.copy_(torch.randn(out_features, generator=g))
    assert torch.equal(torch_dequantize(layer.weight, qtype, torch.float32), exact)
    linear = torch.nn.functional.linear
    for kernels in kernel_builds:
        layer.use_cpu_kernels(kernels, native_bf16=False, buffer=WidenBuffer())
        assert torch.equal(layer.dequantized(0, out_features, torch.float32), exact)
        assert torch.equal(layer.dequantized(8, 40, torch.bfloat16), exact[8:40].bfloat16())
        for rows in (1, 2, 5, 24, 40):
            x = torch.randn(rows, in_features, generator=g)
            want = linear(x.double(), exact.double(), layer.bias.double()).float()
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
            got = layer(x.bfloat16())
            assert got.dtype == torch.bfloat16
            # decode rows read the exact weights; a prefill's bf16 tiles hold them rounded to bf16
            weights = exact if rows <= KERNEL_MAX_ROWS else exact.bfloat16().float()
            torch.testing.assert_close(got.float(), linear(x.bfloat16().float(), weights, layer.bias),
                                       rtol=2e-2, atol=5e-2)
        layer.use_cpu_kernels(kernels, native_bf16=True, buffer=WidenBuffer())  # bf16 prefill tiles by F.linear
        x = torch.randn(40, in_features, generator=g).bfloat16()
        torch.testing.assert_close(layer(x).float(), linear(x.float(), exact.bfloat16().float(), layer.bias),
                                   rtol=2e-2, atol=5e-2)


def test_k_quant_rows_must_be_whole_super_blocks() -> None:
    """A K-quant GgmlLinear needs in_features a multiple of 256 (a 32-weight type, of 32), refused by name;
    use_ggml_linears leaves a layer that is not as a widened nn.Linear."""
    from torch import nn

    from ladle.quantization.ggml_linear import GgmlLinear, row_bytes, use_ggml_linears

    with pytest.raises(ValueError, match=r"whole 256-weight Q4_K blocks, got 288 inputs"):
        GgmlLinear(288, 8, bias=False, qtype="Q4_K")
    assert GgmlLinear(288, 8, bias=False, qtype="Q4_1").weight.shape == (8, 288 // 32 * 20)
    assert row_bytes(512, "Q4_K") == 288 and row_bytes(512, "Q5_K") == 352 and row_bytes(512, "Q6_K") == 420
    with pytest.raises(ValueError, match=r"got Q3_K"):
        GgmlLinear(256, 8, bias=False, qtype="Q3_K")
    with torch.device("meta"):
        root = nn.Module()
        root.wide, root.odd = nn.Linear(512, 8, bias=False), nn.Linear(288, 8, bias=False)
    kept = use_ggml_linears(root, {"wide.weight": "Q6_K", "odd.weight": "Q6_K"})
    assert kept == {"wide.weight"} and isinstance(root.wide, GgmlLinear) and root.wide.qtype == "Q6_K"
    assert type(root.odd) is nn.Linear


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny llama (hidden 256, intermediate 512: every linear's inputs whole super-blocks) as an F32 GGUF
    file, and its tokenizer."""
    from ladle.testing.gguf_checkpoints import tiny_hf_model, write_gguf

    model, tok = tiny_hf_model("llama", seed=1, hidden_size=256, intermediate_size=512)
    root = tmp_path_factory.mktemp("kquants")
    return write_gguf(model, tok, root / "f32" / "tiny-llama.F32.gguf", "llama", "F32"), tok


@pytest.mark.parametrize("qtype,by_name", [("Q4_K", {"ffn_down": "Q6_K"}), ("Q5_K", {})],
                         ids=["Q4_K_M", "Q5_K"])
def test_k_quant_file_stays_blocks_and_equals_hf_gguf_load(f32_file, tmp_path: Path, qtype: str,
                                                           by_name: dict[str, str]) -> None:
    """A llama file with Q4_K linears and Q6_K ffn_down (llama-quantize's Q4_K_M keeps ffn_down at 6 bits), or
    all Q5_K: on CPU every decoder linear is a GgmlLinear in its file type over the file's bytes, and ladle's
    greedy tokens equal transformers' gguf_file= load token for token under chunked prefill, prompts batched
    (prefill tiles widened exactly, decode rows through ggml_linear)."""
    from transformers import AutoModelForCausalLM

    from ladle.quantization.ggml_linear import GgmlLinear, row_bytes
    from ladle.testing.gguf_kquants import quantize_file

    src, _ = f32_file
    file = quantize_file(src, tmp_path / "k" / f"tiny-llama.{qtype}.gguf", qtype, by_name)
    llm = LLM(str(file), max_num_batched_tokens=16, max_prefill_length=7, max_model_len=256)
    model = llm.engine.core.model_executor.runner.model
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, GgmlLinear) and name.startswith("model.layers.")}
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    for name, m in layers.items():
        assert m.qtype == (by_name.get("ffn_down", qtype) if name.endswith("down_proj") else qtype), name
        assert m.weight.dtype == torch.uint8 and m.weight.shape == (m.out_features, row_bytes(m.in_features, m.qtype))
    prompts = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
    assert all(len(p) > 7 for p in prompts)  # every prompt is prefilled in several chunks
    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == want
    assert llm.stats.num_prefill_chunks > len(prompts)


def test_quantize_k_round_trips_through_gguf_dequantize() -> None:
    """The test files' K-quant encoder writes llama.cpp's layout: gguf's dequantize gives the weights back
    within each type's rounding (relative mean error about 2^-bits), an all-zero super-block as zeros."""
    import gguf
    from gguf.quants import dequantize

    from ladle.testing.gguf_kquants import quantize_k

    weights = (np.random.default_rng(0).standard_normal((16, 512)) * 0.02).astype(np.float32)
    weights[0, :256] = 0
    for qtype, bound in (("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.03)):
        back = dequantize(quantize_k(weights, qtype), gguf.GGMLQuantizationType[qtype])
        assert np.abs(back - weights).mean() / np.abs(weights).mean() < bound, qtype
        assert not back[0, :256].any()
