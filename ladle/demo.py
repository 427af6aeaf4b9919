"""Offline checkpoints: a byte-level BPE tokenizer and random-weight Qwen3 / Llama models.

No model hub is reachable where ladle is built and tested, so every checkpoint the tests, benchmarks and
README demo use is generated here, deterministically, from text that ships with every Python install.
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style ChatML. Content may be a string or OpenAI-style parts; only text parts are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Stdlib sources, read from disk (never imported). Deterministic for one CPython version; another version's
# sources give a different (equally valid) tokenizer, which is fine: fixtures build where tests run.
_CORPUS_MODULES = (
    "argparse", "calendar", "collections", "dataclasses", "difflib", "email.message", "enum", "functools",
    "http.client", "inspect", "json.decoder", "json.encoder", "logging", "pathlib", "pydoc", "shutil",
    "string", "subprocess", "textwrap", "threading", "typing",
)

# Fixed prose so the tokenizer has English merges regardless of the stdlib version, and multilingual lines
# so some merges join bytes of multi-byte characters (the case incremental detokenization must get right).
_FIXED_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model reads a prompt, one token at a time, and
writes an answer. The engine splits every long prompt into chunks, so the memory one step needs is bounded
by the number of tokens in that step, and never by the length of the whole prompt. Hello, world! How are
you today? I am fine, thank you. What is the capital of France? The capital of France is Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Dates: 2024-01-01, 1999-12-31.
Café, naïve, résumé, Straße, smörgåsbord, jalapeño, façade.
你好，世界！今天天气很好。我们一起学习语言模型。中文文本的分词测试。
こんにちは、世界。日本語のテキストです。
안녕하세요, 세계. 한국어 문장입니다.
Привет, мир! Это тест. Γειά σου κόσμε. مرحبا بالعالم. שלום עולם.
Emoji: 😀 😃 😄 😁 🚀 🌍 🎉 👍 ❤️ 🔥 ✨ 🤖 👨‍👩‍👧‍👦 🇫🇷 🇯🇵
"""


def _corpus() -> list[str]:
    texts: list[str] = [_FIXED_TEXT] * 8
    for name in _CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            texts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return texts


def build_tokenizer(out_dir: str | Path, vocab_size: int = 4096, added_tokens: tuple[str, ...] = (),
                    chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE and save it as a transformers fast tokenizer; returns the tokenizer.

    Deterministic. The corpus supports about 11,800 tokens: a larger vocab_size yields that many.
    added_tokens: plain (not special) tokens after the specials, as Qwen's <think> and <tool_call> are, so the
    vocabulary is vocab_size + len(added_tokens); chat_template: the tokenizer's template (ChatML by default).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size must be >= {256 + n_special} (bytes + special tokens), got {vocab_size}")
    # No normalizer: a byte-level tokenizer without one round-trips any UTF-8 string exactly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Added after training so specials get the last ids, as in Qwen: ids [0, 256) stay plain byte tokens.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(added_tokens))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out)
    # transformers 5 writes its own class name ("TokenizersBackend"), unknown to 4.x; the generic fast
    # class loads on both, so a demo model built here loads wherever ladle runs.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return hf_tok


# std 0.02 (the HF default) gives near-flat logits: greedy decoding repeats one token and top-2 gaps are
# tiny, so a fp32 reordering could flip argmax. 0.2 gives varied greedy text and clear top-2 gaps.
DEFAULT_INIT_RANGE = 0.2


def build_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    added_tokens: tuple[str, ...] = (),
    chat_template: str = CHAT_TEMPLATE,
    **extra_config: Any,
) -> str:
    """Build tokenizer + random-weight model into out_dir (safetensors, float32); returns out_dir as str.

    added_tokens and chat_template go to build_tokenizer (the model's vocabulary grows by the added tokens);
    extra_config is passed to the HF config (e.g. rope_parameters, rms_norm_eps, initializer_range).
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV4Config,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    config_classes = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig,
                      "mistral": MistralConfig, "qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig,
                      "deepseek_v4": DeepseekV4Config}
    if arch not in config_classes:
        raise ValueError(f"arch must be one of {sorted(config_classes)}, got {arch!r}")
    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size, added_tokens=tuple(added_tokens), chat_template=chat_template)
    endoftext_id = tok.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tok.convert_tokens_to_ids(IM_END)

    extra_config.setdefault("initializer_range", DEFAULT_INIT_RANGE)
    config = config_classes[arch](
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype="float32",
        **extra_config,
    )
    # fork_rng: seeding must not leak into the caller's global torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fill_hash_tables(model)
    # Like Qwen's instruct checkpoints: generation stops at either end marker.
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=[im_end_id, endoftext_id],
        pad_token_id=endoftext_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def fill_hash_tables(model: Any) -> None:
    """HF zero-fills DeepSeek-V4's hash-routing tables (tid2eid); a real one sends each token to distinct
    experts, so a random checkpoint gets a random table of distinct experts (from torch's global RNG)."""
    import torch

    with torch.no_grad():
        for name, table in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                table.copy_(torch.rand(table.shape[0], experts).argsort(dim=-1)[:, : table.shape[1]])


_DEMO_MODEL: Mapping[str, Any] = MappingProxyType(
    dict(
        arch="qwen3",
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        seed=0,
    )
)


def demo_model_kwargs() -> dict[str, Any]:
    """Settings of the README demo model: small enough to build in seconds, big enough to batch and chunk."""
    return dict(_DEMO_MODEL)


_DEMO_README = """\
# ladle demo model (random weights)

Built offline by `ladle demo-model` (`ladle.demo.build_demo_model`). The weights are **random**: its text is
gibberish. It exists to exercise the engine (batching, chunked prefill, paged KV cache, the server) on a
machine with no model hub access, with a real Qwen3 architecture, safetensors weights and a ChatML
byte-level BPE tokenizer trained on Python's standard library sources.

Settings:

```json
{settings}
```
"""


def build_demo_model(out_dir: str | Path) -> str:
    """Build the README demo checkpoint into out_dir; returns out_dir as str."""
    kwargs = demo_model_kwargs()
    path = build_checkpoint(out_dir, **kwargs)
    readme = _DEMO_README.format(settings=json.dumps(kwargs, indent=2))
    (Path(path) / "README.md").write_text(readme, encoding="utf-8")
    return path
