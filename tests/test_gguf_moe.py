"""GGUF Qwen3-MoE (llama.cpp's qwen3moe, issue 57): a tiny file written as llama.cpp's converter writes one (the
experts as three stacked [experts, out, in] tensors a layer, the router F32) loads in ladle with transformers'
gguf_file= greedy tokens under chunked prefill, in F32 and Q8_0; the experts are widened to the model dtype
while the attention linears stay Q8_0 blocks; a missing expert stack, a shared-expert key, or tiered experts
fail at load naming what is wrong."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_oracle import hf_greedy, ladle_tokens
from ladle import LLM, SamplingParams
from ladle.testing.gguf_checkpoints import tiny_hf_model, write_gguf

# Long enough to be prefilled in several chunks of 7, of different lengths so a step mixes a decode with
# another request's prefill chunk.
PROMPTS = ["The quick brown fox jumps over the lazy dog, and the engine splits every long prompt into chunks.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
           "Hello, world! What is the capital of France?"]
MAX_TOKENS = 10
CHUNKED = dict(max_num_batched_tokens=16, max_prefill_length=7, max_model_len=256)


@functools.cache
def _model() -> tuple[Any, Any]:
    return tiny_hf_model("qwen3_moe", seed=4)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory: pytest.TempPathFactory):
    """qtype -> the tiny qwen3moe file in that type, alone in its directory, written once per module."""
    root = tmp_path_factory.mktemp("gguf_moe")

    @functools.cache
    def make(qtype: str) -> Path:
        model, tok = _model()
        return write_gguf(model, tok, root / qtype / f"tiny-qwen3moe.{qtype}.gguf", "qwen3moe", qtype)

    return make


def _model_of(llm: LLM) -> Any:
    return llm.engine.core.model_executor.runner.model


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_greedy_equals_hf_gguf_load_under_chunked_prefill(moe_file, qtype: str) -> None:
    """ladle's tokens equal transformers' gguf_file= load of the same file (which dequantizes with the same gguf
    package). transformers' qwen3moe loader does not read expert_feed_forward_length, so it is told
    moe_intermediate_size; it sets norm_topk_prob true as llama.cpp computes, as ladle's config does."""
    from transformers import AutoModelForCausalLM

    from ladle.models.layers.moe import FusedMoE
    from ladle.quantization.ggml_linear import GgmlLinear

    file = moe_file(qtype)
    llm = LLM(str(file), **CHUNKED)
    model = _model_of(llm)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.w13.dtype == torch.float32 and m.w13.shape == (8, 64, 64) for m in experts)
    blocks = [m for name, m in model.named_modules() if isinstance(m, GgmlLinear) and name.startswith("model.")]
    # Q8_0: each layer's q/k/v and o_proj stay blocks, and the head; the router is F32 in the file and the
    # experts widened
    assert len(blocks) == (2 * 2 if qtype == "Q8_0" else 0) and all(m.qtype == "Q8_0" for m in blocks)
    assert isinstance(model.cpu_head, GgmlLinear) == (qtype == "Q8_0")
    setting = llm.engine.core.config.settings["quantization"]
    assert setting.value == "gguf" and "MoE experts included (no grouped block kernel yet)" in setting.reason
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert all(len(p) > 7 for p in prompts)  # every prompt is prefilled in several chunks
    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                              moe_intermediate_size=32).eval()
    assert hf.config.norm_topk_prob and not hf.config.tie_word_embeddings
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert ladle_tokens(llm, prompts, params) == want
    assert all(s.num_tokens <= 16 for s in llm.stats.steps) and llm.stats.num_prefill_chunks > len(prompts)


def test_config_from_metadata(moe_file) -> None:
    """The expert fields come from the file's qwen3moe.expert_* keys; what llama.cpp's qwen3moe graph fixes
    (renormalised top-k, every layer sparse) is set; the untied head is read from output.weight."""
    from ladle.models.loading.loader import load_config

    model, _ = _model()
    config = load_config(str(moe_file("Q8_0")))
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim", "hidden_size",
                  "num_hidden_layers", "num_key_value_heads", "intermediate_size"):
        assert getattr(config, field) == getattr(model.config, field), field
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.norm_topk_prob
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [] and not config.tie_word_embeddings


def test_missing_expert_stack_is_named(tmp_path: Path) -> None:
    from ladle.models.loading.loader import load_model

    model, tok = _model()
    path = write_gguf(model, tok, tmp_path / "bad.gguf", "qwen3moe", "Q8_0", drop=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors the config needs: blk\.1\.ffn_down_exps\.weight"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def test_shared_expert_key_is_refused_by_name(tmp_path: Path) -> None:
    from gguf import GGUFValueType

    from ladle.models.loading.loader import load_config

    model, tok = _model()
    path = write_gguf(model, tok, tmp_path / "shared.gguf", "qwen3moe", "Q8_0", extra_keys={
        "qwen3moe.expert_shared_feed_forward_length": (64, GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match=r"metadata key 'qwen3moe\.expert_shared_feed_forward_length' \(= 64\) "
                                         r"describes a shared expert"):
        load_config(str(path))


def test_tiered_experts_are_refused(moe_file) -> None:
    """Tiering reads experts from safetensors files when it needs them; a GGUF file says so at load."""
    with pytest.raises(ValueError, match=r"tiny-qwen3moe\.Q8_0\.gguf: tiered experts .* cannot be used with a "
                                         r"GGUF checkpoint yet"):
        LLM(str(moe_file("Q8_0")), moe_cache_size=4, **CHUNKED)
