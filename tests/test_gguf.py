"""GGUF checkpoints (issue 57): tiny files written with gguf's writer in each block type, llama (Q/K rows
permuted as llama.cpp's converter does), qwen2 (q/k/v biases) and qwen3 (q/k norm); ladle's greedy tokens equal
transformers' gguf_file= load (which dequantizes with the same gguf package) token for token under chunked
prefill, and bad files fail at load naming what is wrong."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.kernels.cpu_isa import CpuIsa, kernel_levels
from ladle.testing.gguf_checkpoints import tiny_hf_model, write_gguf

# Prompts long enough to be cut into several chunks by max_prefill_length 7, of different lengths so a step
# mixes a decode with another request's prefill chunk.
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the engine splits every long prompt into chunks.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
           "Hello, world! What is the capital of France?"]
MAX_TOKENS = 10


@functools.cache
def _model(arch: str) -> tuple[Any, Any]:
    return tiny_hf_model(arch, seed={"llama": 1, "qwen2": 2, "qwen3": 3}[arch])


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory):
    """(arch, qtype) -> a directory holding that file alone, written once per module."""
    root = tmp_path_factory.mktemp("gguf")

    @functools.cache
    def make(arch: str, qtype: str) -> Path:
        model, tok = _model(arch)
        write_gguf(model, tok, root / f"{arch}_{qtype}" / f"tiny-{arch}.{qtype}.gguf", arch, qtype)
        return root / f"{arch}_{qtype}"

    return make


def _hf(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    name = next(directory.glob("*.gguf")).name
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def _prompt_ids(tokenizer: Any) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("arch,qtype", [
    ("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
    ("qwen2", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "F16"), ("qwen3", "Q4_0"),
])
def test_greedy_equals_hf_gguf_load_under_chunked_prefill(gguf_dir, arch: str, qtype: str) -> None:
    directory = gguf_dir(arch, qtype)
    file = next(directory.glob("*.gguf"))
    llm = LLM(str(file), max_num_batched_tokens=16, max_prefill_length=7, max_model_len=256)
    prompts = _prompt_ids(llm.get_tokenizer())
    assert all(len(p) > 7 for p in prompts)  # every prompt is prefilled in several chunks
    hf = _hf(directory)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == want
    assert all(s.num_tokens <= 16 for s in llm.stats.steps) and llm.stats.num_prefill_chunks > len(prompts)


def test_model_as_a_directory_holding_one_gguf(gguf_dir, tmp_path: Path) -> None:
    """--model DIR with one .gguf and no config.json loads that file; a second .gguf makes it ambiguous."""
    from ladle.models.loading.loader import load_config

    directory = gguf_dir("llama", "Q8_0")
    assert load_config(str(directory)).architectures == ["LlamaForCausalLM"]
    two = tmp_path / "two"
    shutil.copytree(directory, two)
    shutil.copy(next(two.glob("*.gguf")), two / "copy.gguf")
    with pytest.raises(FileNotFoundError, match=r"holds 2 GGUF files .*copy\.gguf.*pass --model FILE\.gguf"):
        load_config(str(two))


def test_config_from_metadata(gguf_dir) -> None:
    """Every field the model computes with comes from the file: sizes, heads, head size, rope base, eps, tied
    head (no output.weight), special ids; llama's 4/2 heads, qwen3's head size from attention.key_length."""
    from ladle.models.loading.loader import load_config

    model, _ = _model("qwen3")
    config = load_config(str(gguf_dir("qwen3", "F16")))
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "pad_token_id", "eos_token_id"):
        assert getattr(config, field) == getattr(model.config, field), field
    assert config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    assert config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings and config.architectures == ["Qwen3ForCausalLM"]  # no output.weight
    assert load_config(str(gguf_dir("llama", "F32"))).tie_word_embeddings is False


def test_reader_equals_gguf_reader(gguf_dir) -> None:
    """ladle's header reader gives what gguf's GGUFReader gives: every key's value, every tensor's type, shape
    and bytes."""
    from gguf import GGUFReader

    from ladle.gguf.reader import read_gguf

    for arch, qtype in (("llama", "Q4_1"), ("qwen2", "Q8_0")):
        file = next(gguf_dir(arch, qtype).glob("*.gguf"))
        ours, theirs = read_gguf(file), GGUFReader(file)
        keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
        assert keys == list(ours.metadata)
        for key in keys:
            value = ours.metadata[key]
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == theirs.fields[key].contents(), key
        assert [t.name for t in theirs.tensors] == list(ours.tensors)
        for t in theirs.tensors:
            info = ours.tensors[t.name]
            assert info.qtype == t.tensor_type and info.dims == tuple(int(d) for d in t.shape)
            assert np.array_equal(ours.raw(info), np.asarray(t.data)), t.name


def test_tokenizer_equals_transformers_gguf_tokenizer(gguf_dir) -> None:
    """The tokenizer ladle builds from the file encodes and decodes as transformers' gguf_file= tokenizer and
    as the original, and renders the file's chat template the same."""
    from transformers import AutoTokenizer

    from ladle.tokenizer import load_tokenizer

    directory = gguf_dir("qwen2", "Q8_0")
    ours = load_tokenizer(str(directory))
    theirs = AutoTokenizer.from_pretrained(directory, gguf_file=next(directory.glob("*.gguf")).name)
    _, original = _model("qwen2")
    texts = PROMPTS + ["<|im_start|>user\nhi<|im_end|>", "Café naïve 你好 😀  \n\n\tx = 12345", " leading space"]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids == original(text).input_ids, text
        assert ours.decode(ids) == text
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert ours.eos_token == "<|im_end|>"


def _write_bad(tmp_path: Path, arch: str = "llama", **kwargs: Any) -> str:
    model, tok = _model("llama")
    return str(write_gguf(model, tok, tmp_path / "bad.gguf", arch, "Q8_0", **kwargs))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from ladle.models.loading.loader import load_model

    path = _write_bad(tmp_path, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors the config needs: blk\.1\.ffn_up\.weight"):
        load_model(path, torch.device("cpu"), torch.float32)


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    from ladle.models.loading.loader import load_config

    path = _write_bad(tmp_path, arch="falcon")
    with pytest.raises(ValueError, match=r"general\.architecture 'falcon' is not one ladle loads from GGUF; "
                                         r"supported: llama, qwen2, qwen3"):
        load_config(path)


@pytest.mark.parametrize("key,value,message", [
    ("llama.attention.sliding_window", (256, "UINT32"), r"metadata key 'llama\.attention\.sliding_window' \(= 256\)"),
    ("llama.logit_scale", (0.5, "FLOAT32"), r"metadata key 'llama\.logit_scale' \(= 0\.5\)"),
    ("llama.rope.scaling.type", ("linear", "STRING"), r"llama\.rope\.scaling\.type 'linear' is not implemented"),
])
def test_computation_changing_key_is_refused_by_name(tmp_path: Path, key: str, value: tuple, message: str) -> None:
    from gguf import GGUFValueType

    from ladle.models.loading.loader import load_config

    path = _write_bad(tmp_path, extra_keys={key: (value[0], GGUFValueType[value[1]])})
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_informational_keys_are_known(tmp_path: Path) -> None:
    """Provenance keys (a licence, a base model's name) load without complaint."""
    from gguf import GGUFValueType

    from ladle.models.loading.loader import load_config

    path = _write_bad(tmp_path, extra_keys={"general.license": ("apache-2.0", GGUFValueType.STRING),
                                            "general.base_model.0.name": ("base", GGUFValueType.STRING)})
    assert load_config(path).num_hidden_layers == 2


def test_misshapen_tensor_is_named(tmp_path: Path) -> None:
    """A file whose metadata says a wider MLP than its tensors hold fails naming the first tensor that differs."""
    from gguf import GGUFValueType

    from ladle.models.loading.loader import load_model

    model, tok = _model("llama")
    path = tmp_path / "wide.gguf"
    write_gguf(model, tok, path, "llama", "Q8_0")
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4  # the key, then its uint32 value type, then the value
    assert int.from_bytes(data[at:at + 4], "little") == 128 and GGUFValueType.UINT32 == 4
    data[at:at + 4] = (160).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_gate\.weight' has shape \[128, 64\] where the "
                                         r"metadata implies \[160, 64\]"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def _model_of(llm: LLM) -> Any:
    return llm.engine.core.model_executor.runner.model


@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", "Q8_0"), ("qwen2", "Q4_0"), ("qwen3", "Q4_1")])
def test_blocks_stay_quantized_and_equal_the_widened_path(gguf_dir, arch: str, qtype: str) -> None:
    """On CPU every decoder linear of a Q8_0 / Q4_0 / Q4_1 file is a GgmlLinear over the file's block bytes (a
    fraction of the widened model's bytes), the embedding a GgmlEmbedding, and the head a GgmlLinear: its own
    (qwen2, untied) or one over the embedding's very Parameter (qwen3, tied); greedy tokens equal
    --dequantize-weights' (the same file widened at load) token for token under chunked prefill, prompts
    batched together."""
    from ladle.quantization.ggml_embedding import GgmlEmbedding
    from ladle.quantization.ggml_linear import BLOCK_TYPES, GgmlLinear

    file = str(next(gguf_dir(arch, qtype).glob("*.gguf")))
    kwargs = dict(max_num_batched_tokens=16, max_prefill_length=7, max_model_len=256)
    quantized, widened = LLM(file, **kwargs), LLM(file, dequantize_weights=True, **kwargs)
    model = _model_of(quantized)
    layers = [m for name, m in model.named_modules() if isinstance(m, GgmlLinear) and name.startswith("model.layers.")]
    assert len(layers) == 2 * 4 and all(m.qtype == qtype and m.weight.dtype == torch.uint8 for m in layers)
    embed = model.model.embed_tokens
    assert isinstance(embed, GgmlEmbedding) and embed.qtype == qtype and embed.weight.dtype == torch.uint8
    assert isinstance(model.cpu_head, GgmlLinear) and model.cpu_head.qtype == qtype
    assert (model.cpu_head.weight is embed.weight) == (arch == "qwen3")
    assert not any(isinstance(m, (GgmlLinear, GgmlEmbedding)) for m in _model_of(widened).modules())
    linear_bytes = sum(m.weight.numel() for m in layers)
    assert linear_bytes == sum(m.out_features * m.in_features for m in layers) // 32 * BLOCK_TYPES[qtype][1]
    prompts = _prompt_ids(quantized.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ladle_tokens(quantized, prompts, params) == ladle_tokens(widened, prompts, params)


@pytest.mark.parametrize("level", kernel_levels(), ids=lambda level: level.label)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_kernels_against_gguf_dequantize(qtype: str, level: CpuIsa) -> None:
    """ggml_dequantize (C) and the torch fallback widen to exactly gguf's dequantize values; ggml_linear (C,
    the decode rows, at every instruction-set level this CPU runs) matches F.linear over them for 1..24 rows in
    fp32 and bf16, with a bias; a prefill's rows widen tile by tile to the same product."""
    import gguf
    from gguf.quants import dequantize, quantize

    from ladle.kernels import cpu_kernels
    from ladle.quantization.fp8_linear import WidenBuffer
    from ladle.quantization.ggml_linear import GgmlLinear, torch_dequantize

    kernels = cpu_kernels.load(level)
    g = torch.Generator().manual_seed(0)
    out_features, in_features = 72, 160
    weights = (torch.randn(out_features, in_features, generator=g) * 0.3).numpy()
    raw = quantize(weights, gguf.GGMLQuantizationType[qtype])
    exact = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))
    layer = GgmlLinear(in_features, out_features, bias=True, qtype=qtype)
    layer.weight.data.copy_(torch.from_numpy(raw))
    layer.bias.data.copy_(torch.randn(out_features, generator=g))
    assert torch.equal(torch_dequantize(layer.weight, qtype, torch.float32), exact)
    layer.use_cpu_kernels(kernels, native_bf16=False, buffer=WidenBuffer())
    assert torch.equal(layer.dequantized(0, out_features, torch.float32), exact)
    assert torch.equal(layer.dequantized(8, 40, torch.bfloat16), exact[8:40].bfloat16())
    for rows in (1, 2, 5, 24, 40):
        x = torch.randn(rows, in_features, generator=g)
        want = torch.nn.functional.linear(x, exact, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
        got = layer(x.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    layer.use_cpu_kernels(kernels, native_bf16=True, buffer=WidenBuffer())  # bf16 prefill tiles by F.linear
    x = torch.randn(40, in_features, generator=g).bfloat16()
    torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x.float(), exact, layer.bias),
                               rtol=2e-2, atol=5e-2)


def test_qwen2_safetensors_checkpoint_equals_hf(tmp_path: Path) -> None:
    """Qwen2ForCausalLM (q/k/v biases, none on o_proj), new with GGUF's qwen2, loads from an HF checkpoint
    directory too, with HF's greedy tokens."""
    model, tok = _model("qwen2")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, max_prefill_length=7, max_model_len=256)
    prompts = _prompt_ids(tok)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
