"""ladle.demo: offline checkpoints are deterministic, load in transformers, and have a ChatML tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ladle.demo import build_checkpoint, build_demo_model, build_tokenizer, demo_model_kwargs

SMALL = dict(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
             tie_word_embeddings=False)


def test_build_checkpoint_is_deterministic(tmp_path: Path) -> None:
    a = Path(build_checkpoint(tmp_path / "a", "llama", **SMALL, seed=3))
    b = Path(build_checkpoint(tmp_path / "b", "llama", **SMALL, seed=3))
    c = Path(build_checkpoint(tmp_path / "c", "llama", **SMALL, seed=4))
    names = sorted(p.name for p in a.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_build_does_not_touch_the_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_checkpoint(tmp_path / "m", "qwen3", **SMALL, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        build_checkpoint(tmp_path, "gpt2", **SMALL)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_checkpoints_load_in_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = request.getfixturevalue(f"hf_{arch}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == len(tok) == 512
    assert config["tie_word_embeddings"] == (arch == "qwen3")
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert hf.dtype == torch.float32 and not hf.training
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    if arch == "llama":
        rope = config["rope_parameters"]
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
        assert rope["original_max_position_embeddings"] == 512
    with torch.no_grad():
        logits = hf(torch.tensor([tok.encode("Hello, world!")])).logits
    assert logits.shape[-1] == 512 and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_is_varied(arch: str, request: pytest.FixtureRequest, tokenizer: Any) -> None:
    # The init scale exists for this: HF's default 0.02 makes tiny models repeat one token forever.
    hf = request.getfixturevalue(f"hf_{arch}")
    for prompt in ["The quick brown fox", "def main():\n    return", "你好，世界"]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                              eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:].tolist()
        assert len(set(new)) >= 10, (prompt, new)
        top2 = torch.stack(out.scores)[:, 0].topk(2).values
        assert (top2[:, 0] - top2[:, 1]).median() > 0.05  # argmax is not a near-tie


def test_chat_template_renders_chatml(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi!<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # specials are single tokens
    assert tokenizer.decode(ids) == text


ROUND_TRIP = ["plain ASCII text", "Café naïve Straße", "你好，世界！日本語 한국어", "emoji 😀🚀👨‍👩‍👧‍👦🇫🇷",
              "\x00\x01 tabs\tand\nnewlines\r\n", "\ufffd literal", ""]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trips_utf8(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_last_and_not_split(tokenizer: Any) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert [tokenizer.convert_tokens_to_ids(s) for s in specials] == [509, 510, 511]
    assert tokenizer.encode("<|im_start|>user")[0] == 510
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.bos_token is None
    assert tokenizer.decode([511, 509], skip_special_tokens=True) == ""


def test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a", 1000)
    build_tokenizer(tmp_path / "b", 1000)
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "a")) == 1000


def test_build_demo_model(tmp_path: Path) -> None:
    kwargs = demo_model_kwargs()
    kwargs["seed"] = 99
    assert demo_model_kwargs()["seed"] == 0  # a fresh dict each call: callers cannot change the defaults
    path = Path(build_demo_model(tmp_path / "demo"))
    assert "random" in (path / "README.md").read_text()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["hidden_size"] == 256
    assert config["max_position_embeddings"] == 8192 and config["vocab_size"] == 8192
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in hf.parameters()) > 1_000_000
