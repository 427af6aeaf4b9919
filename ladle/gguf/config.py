"""A GGUF file's metadata as the HF config ladle builds models from, every key read or refused by name.

llama.cpp spells an HF config as `{arch}.*` keys. Each key of a file is one of: read into the config (below),
read by the tokenizer (ladle.gguf.tokenizer), checked to hold the one value ladle computes with, or known to be
informational (names, licences, provenance). Any other key could change what the model computes in llama.cpp
(a logit scale, a sliding window, a rope scaling), so loading stops naming it instead of running a different
model than the file describes.

Mixture-of-experts files (qwen3moe) add the `{arch}.expert_*` keys llama.cpp's qwen3moe reads; what its graph
hard-codes rather than reads (every layer routed, softmax over all experts, top-k weights renormalised, no
shared expert) is set in the config as the values it computes with.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ladle.gguf.reader import GGUFFile

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# general.architecture -> the HF architecture ladle builds.
ARCHITECTURES: Mapping[str, str] = MappingProxyType({
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
})
# general.architecture -> the HF model_type of its config.
_MODEL_TYPES: Mapping[str, str] = MappingProxyType({
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
})
# Architectures whose layers route tokens to experts (the `{arch}.expert_*` keys below).
_MOE = frozenset({"qwen3moe"})

# `{arch}.` keys -> HF config fields, shared by the dense decoders.
_CONFIG_FIELDS: Mapping[str, str] = MappingProxyType({
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
})
_REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.layer_norm_rms_epsilon")
# `{arch}.` keys checked against the config rather than copied: they must say what ladle computes anyway.
_CHECKED = ("rope.dimension_count", "attention.key_length", "attention.value_length", "rope.scaling.type")
# `{arch}.` keys of a MoE architecture, read into the config by _expert_fields.
_EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")
# `{arch}.` keys refused with a reason more useful than "unknown" (a MoE variant ladle's model lacks).
_REFUSED: Mapping[str, str] = MappingProxyType({
    "expert_shared_feed_forward_length": "a shared expert (Qwen2-MoE's); llama.cpp's qwen3moe and ladle's "
                                         "Qwen3-MoE have none",
    "expert_shared_count": "shared experts; llama.cpp's qwen3moe and ladle's Qwen3-MoE have none",
})

# Read by ladle.gguf.tokenizer (or, for the special ids, by the config's eos / bos below).
TOKENIZER_KEYS = frozenset({
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
})
# Byte-level BPE has no scores; llama.cpp writes them for some gpt2 vocabularies and never reads them there.
_IGNORED_FOR_BPE = frozenset({"tokenizer.ggml.scores"})

# Informational: names, licences, provenance, the file's own bookkeeping. None of them changes a computation
# (general.file_type only summarises the tensor types, which ladle reads per tensor; general.alignment is
# applied by the reader).
INFORMATIONAL = frozenset({
    "general.type", "general.name", "general.author", "general.version", "general.organization",
    "general.basename", "general.finetune", "general.description", "general.quantized_by", "general.size_label",
    "general.license", "general.license.name", "general.license.link", "general.url", "general.doi",
    "general.uuid", "general.repo_url", "general.source.url", "general.source.doi", "general.source.uuid",
    "general.source.repo_url", "general.base_model.count", "general.dataset.count", "general.tags",
    "general.languages", "general.datasets", "general.file_type", "general.quantization_version",
    "general.alignment", "general.source.huggingface.repository", "general.sampling.top_k", "general.sampling.top_p",
    "general.sampling.temp", "quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
    "quantize.imatrix.chunks_count",
})
# Indexed provenance (general.base_model.0.name, general.dataset.1.repo_url, ...) and named extra chat templates
# (tokenizer.chat_template.tool_use: ladle renders the default template; a named one is never selected).
_INFORMATIONAL_PATTERN = re.compile(r"general\.(base_model|dataset)\.\d+\.\w+|tokenizer\.chat_template\.\w+")


class GGUFConfigError(ValueError):
    """The file's metadata describes a model ladle cannot build exactly."""


def architecture_of(gguf: GGUFFile) -> str:
    """The file's general.architecture, checked to be one ladle builds."""
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise GGUFConfigError(f"{gguf.path}: general.architecture {arch!r} is not one ladle loads from GGUF; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_config_of(gguf: GGUFFile) -> PretrainedConfig:
    """The HF config (LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig) the file's metadata describes;
    raises naming the first key ladle does not understand or whose value it cannot compute with."""
    from transformers import AutoConfig

    arch = architecture_of(gguf)
    md = gguf.metadata
    check_keys(gguf, arch)
    # llama.cpp's qwen3moe reads feed_forward_length only where expert_feed_forward_length is absent
    required = [k for k in _REQUIRED if not (arch in _MOE and k == "feed_forward_length"
                                             and f"{arch}.expert_feed_forward_length" in md)]
    missing = [f"{arch}.{k}" for k in required if f"{arch}.{k}" not in md]
    if missing:
        raise GGUFConfigError(f"{gguf.path}: metadata lacks {', '.join(missing)}")
    fields: dict[str, Any] = {hf: md[f"{arch}.{k}"] for k, hf in _CONFIG_FIELDS.items() if f"{arch}.{k}" in md}
    heads = int(fields["num_attention_heads"])
    kv_heads = fields.get("num_key_value_heads", heads)
    if not isinstance(kv_heads, int):  # llama.cpp writes an array for models whose layers differ
        raise GGUFConfigError(f"{gguf.path}: {arch}.attention.head_count_kv differs per layer ({list(kv_heads)}); "
                              "ladle builds models whose layers all have the same heads")
    fields["num_key_value_heads"] = kv_heads
    # llama.cpp's defaults where a key is absent (llama_model_loader): rope base 10000, vocabulary from tokens.
    fields.setdefault("rope_theta", 10000.0)
    tokens = md.get("tokenizer.ggml.tokens")
    fields.setdefault("vocab_size", len(tokens) if tokens is not None else None)
    if fields["vocab_size"] is None:
        raise GGUFConfigError(f"{gguf.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary")
    head_dim = _head_dim(gguf, arch, int(fields["hidden_size"]), heads)
    fields["head_dim"] = head_dim
    _check_rope(gguf, arch, head_dim)
    fields["tie_word_embeddings"] = "output.weight" not in gguf.tensors  # llama.cpp's head is token_embd then
    fields.update(_special_ids(md))
    if arch in _MOE:
        fields.update(_expert_fields(gguf, arch, fields.get("intermediate_size")))
    rope_theta = float(fields.pop("rope_theta"))
    config = AutoConfig.for_model(_MODEL_TYPES[arch],
                                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                                  architectures=[ARCHITECTURES[arch]], hidden_act="silu", dtype="float32",
                                  **{k: (int(v) if isinstance(v, int) and not isinstance(v, bool) else v)
                                     for k, v in fields.items()})
    if arch == "qwen2":  # Qwen2's HF config has no head_dim (hidden / heads); ladle reads head_dim when it is set
        config.head_dim = head_dim
    return config


def check_keys(gguf: GGUFFile, arch: str) -> None:
    """Every key is read, checked, or known informational; the first other one is refused by name."""
    known = {f"{arch}.{k}" for k in (*_CONFIG_FIELDS, *_CHECKED, *(_EXPERT_KEYS if arch in _MOE else ()))}
    known |= {"general.architecture"} | TOKENIZER_KEYS | INFORMATIONAL
    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        known |= _IGNORED_FOR_BPE
    for key in gguf.metadata:
        if key in known or _INFORMATIONAL_PATTERN.fullmatch(key):
            continue
        reason = _REFUSED.get(key.removeprefix(f"{arch}."))
        if reason is not None:
            raise GGUFConfigError(f"{gguf.path}: metadata key {key!r} (= {_shown(gguf.metadata[key])}) describes "
                                  f"{reason}; the file is refused rather than run without it")
        raise GGUFConfigError(f"{gguf.path}: metadata key {key!r} (= {_shown(gguf.metadata[key])}) is not one "
                              f"ladle implements for {arch}; it may change what the model computes, so the file is "
                              "refused rather than run differently")


def _expert_fields(gguf: GGUFFile, arch: str, intermediate_size: int | None) -> dict[str, Any]:
    """The MoE fields of the config: experts, experts a token uses, an expert's intermediate size, and what
    llama.cpp's qwen3moe graph fixes (llm_build_qwen3moe: build_moe_ffn with norm_w true, softmax gating, every
    layer): top-k weights renormalised whatever the HF config's norm_topk_prob was (the converter does not
    write it; transformers' GGUF loader sets it true for the same reason), no dense layers."""
    md = gguf.metadata
    values: dict[str, int] = {}
    for key in _EXPERT_KEYS:
        value = md.get(f"{arch}.{key}")
        # llama.cpp reads expert_used_count and expert_feed_forward_length per layer where an array is given
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise GGUFConfigError(f"{gguf.path}: {arch}.{key} is {_shown(value)}, not one integer; ladle builds "
                                  "models whose layers all route alike")
        if value is not None:
            values[key] = value
    missing = [f"{arch}.{k}" for k in ("expert_count", "expert_used_count") if k not in values]
    if missing:
        raise GGUFConfigError(f"{gguf.path}: metadata lacks {', '.join(missing)}, which a {arch} model needs")
    experts, used = values["expert_count"], values["expert_used_count"]
    if not 0 < used <= experts:
        raise GGUFConfigError(f"{gguf.path}: {arch}.expert_used_count {used} is not between 1 and "
                              f"{arch}.expert_count {experts}")
    # llama.cpp's fallback where the key is absent: n_ff / n_expert_used (llama_model_qwen3moe::load_arch_tensors)
    expert_ffn = values.get("expert_feed_forward_length", (intermediate_size or 0) // used)
    if expert_ffn <= 0:
        raise GGUFConfigError(f"{gguf.path}: {arch}.expert_feed_forward_length is absent and "
                              f"{arch}.feed_forward_length gives no expert size")
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": expert_ffn,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _head_dim(gguf: GGUFFile, arch: str, hidden: int, heads: int) -> int:
    md = gguf.metadata
    key_len, value_len = md.get(f"{arch}.attention.key_length"), md.get(f"{arch}.attention.value_length")
    if key_len is not None and value_len is not None and key_len != value_len:
        raise GGUFConfigError(f"{gguf.path}: {arch}.attention.key_length {key_len} != value_length {value_len}; "
                              "ladle's attention has one head size for keys and values")
    head_dim = key_len if key_len is not None else value_len if value_len is not None else hidden // heads
    if key_len is None and value_len is None and hidden % heads:
        raise GGUFConfigError(f"{gguf.path}: {arch}.embedding_length {hidden} is not a multiple of "
                              f"{arch}.attention.head_count {heads}, and no attention.key_length says the head size")
    return int(head_dim)


def _check_rope(gguf: GGUFFile, arch: str, head_dim: int) -> None:
    md = gguf.metadata
    dims = md.get(f"{arch}.rope.dimension_count")
    if dims is not None and dims != head_dim:
        raise GGUFConfigError(f"{gguf.path}: {arch}.rope.dimension_count {dims} != head size {head_dim}; partial "
                              "rope is not implemented for GGUF files")
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFConfigError(f"{gguf.path}: {arch}.rope.scaling.type {scaling!r} is not implemented for GGUF files "
                              "(only 'none')")
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFConfigError(f"{gguf.path}: tensor 'rope_freqs.weight' (llama3-style per-frequency rope factors) "
                              "is not implemented for GGUF files")


def _special_ids(md: Mapping[str, Any]) -> dict[str, Any]:
    """bos / pad ids, and eos as every end-of-generation id the file names (eos, and eot / eom where llama.cpp's
    converter found an end-of-turn token): llama.cpp stops at any of them."""
    out: dict[str, Any] = {}
    for key, field in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in md:
            out[field] = int(md[f"tokenizer.ggml.{key}_token_id"])
    keys = [f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(md[k]) for k in keys if k in md))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _shown(value: Any) -> str:
    text = repr(value if not hasattr(value, "__len__") or isinstance(value, str) else f"<{len(value)} values>")
    return text if len(text) < 80 else text[:77] + "..."
