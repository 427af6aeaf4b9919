"""Session fixtures: tiny random-weight checkpoints built offline, and HF transformers models as the oracle.

Session-scoped because each build costs about a second; tests must treat the models and directories as
read-only (copy a directory with shutil.copytree before changing it).
"""
from __future__ import annotations

from typing import Any

import pytest

from ladle.demo import build_checkpoint

_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=4096,
)

# transformers 5 spells rope scaling `rope_parameters`, with rope_theta inside (it still accepts the old
# `rope_scaling` key and writes `rope_parameters`). With head_dim 16 and theta 5e5 the rotary wavelengths
# (6, 33, 168, 868, ...) fall in all three llama3 bands: < 128 kept, 128..512 smoothed, > 512 divided.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


def _load_hf(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session", autouse=True)
def hf_torch_kernels() -> None:
    """The HF oracle runs its own PyTorch reference, never a kernel package the test extra installs."""
    from ladle.testing.hf_reference import use_torch_kernels

    use_torch_kernels()


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One activation-profile cache for the whole session (servers started by tests inherit it): each model
    shape is profiled once, not once per engine. Fresh per session, so a run never trusts an old one."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("profiles")
        mp.setenv("LADLE_PROFILE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3, tied embeddings, vocab 512, 2 layers, GQA 4/2 heads, head_dim 16, context 4096."""
    return build_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", **_TINY, tie_word_embeddings=True, seed=0
    )


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-MoE, 3 layers: 0 and 2 sparse (8 experts, top 2, renormalised as Qwen3-30B-A3B's config.json
    says), 1 dense."""
    from ladle.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", vocab_size=512, hidden_size=64,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                            max_position_embeddings=2048, seed=3)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama 3 style: untied embeddings and llama3 rope scaling (factor 8 over 512 positions)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"),
        "llama",
        **_TINY,
        tie_word_embeddings=False,
        seed=1,
        rope_parameters=dict(LLAMA3_ROPE),
    )


@pytest.fixture(scope="session")
def hf_qwen3(tiny_qwen3_dir: str) -> Any:
    return _load_hf(tiny_qwen3_dir)


@pytest.fixture(scope="session")
def hf_llama(tiny_llama_dir: str) -> Any:
    return _load_hf(tiny_llama_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_qwen3_dir: str) -> Any:
    """The ChatML byte-level BPE of the tiny checkpoints (both share it: same corpus, same vocab size)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="session")
def q35_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3.5: three Gated DeltaNet layers, then full attention (vocab 512, 64 wide): the tiers' state model."""
    return build_checkpoint(tmp_path_factory.mktemp("q35"), "qwen3_5", vocab_size=512, hidden_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], seed=6)


@pytest.fixture(scope="session")
def dsv4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """DeepSeek-V4 with a small window, compressed and heavily compressed groups (test_deepseek_v4's small_window)."""
    from test_deepseek_v4 import MIXES, build

    path = tmp_path_factory.mktemp("dsv4")
    build(path, 7, **MIXES["small_window"])
    return str(path)
