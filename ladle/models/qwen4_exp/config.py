"""Every field of a Qwen4-Exp text config (HF's Qwen4ExpTextConfig), read, taken as a documented no-op, or
refused by name: a value ladle would otherwise ignore must not change what the model generates unnoticed."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

# Fields the model reads (the engine reads max_position_embeddings, eos/bos ids and tie_word_embeddings too).
READ = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "attention_bias",
    "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "num_experts", "norm_topk_prob", "layer_types", "eos_token_id", "hc_count",
    "hc_lowrank", "ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size", "ngram_size", "heads_per_ngram",
    "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "seed", "split_ngram_parts", "indexer_n_heads",
    "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "output_gate_type",
})
# Fields that cannot change what the model generates at inference, and why.
NO_OPS = MappingProxyType({
    "initializer_range": "the init of random weights; a checkpoint's weights are loaded",
    "use_cache": "ladle always keeps its caches",
    "pad_token_id": "the embedding's padding row, which only training treats apart",
    "bos_token_id": "the model never reads it (the prompt is the tokenizer's and chat template's)",
    "attention_dropout": "dropout is off at inference",
    "output_router_logits": "a training output",
    "router_aux_loss_coef": "a training loss",
    "number_of_conv_states": "HF's cache layout; ladle keeps the same states in its state slot",
    "mtp_num_hidden_layers": "the multi-token-prediction layer, which ladle does not run (its weights are not read)",
})
# The mrope sections of the image-text model: with text only, the three position axes are equal, so every
# section gets the same rotation and the sections change nothing.
_ROPE_KEYS = frozenset({"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"})
LAYER_TYPES = ("linear_attention", "indexed_attention")
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def check_config(config: Any) -> None:
    """Raise, naming the field, on any value ladle's Qwen4-Exp cannot honour."""
    from transformers import PreTrainedConfig

    generic = set(PreTrainedConfig().to_dict())
    unknown = sorted(set(config.to_dict()) - READ - set(NO_OPS) - generic)
    if unknown:
        raise ValueError(f"Qwen4-Exp config fields {unknown} are not supported (ladle reads every field it "
                         "honours and refuses the others)")
    bad_types = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if bad_types:
        raise ValueError(f"layer types {bad_types} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(config.layer_types)} entries for {config.num_hidden_layers} layers")
    if "indexed_attention" not in config.layer_types:
        raise ValueError("a Qwen4-Exp config with no indexed_attention layer (state only) is not supported yet")
    missing = [name for name in _QSA if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"indexed_attention layers need the QSA fields {missing}")
    if config.indexer_kv_heads != 1:
        raise ValueError(f"indexer_kv_heads is {config.indexer_kv_heads}; QSA has one indexer key head")
    if config.indexer_budget % config.indexer_compress_ratio:
        raise ValueError(f"indexer_budget {config.indexer_budget} is not a multiple of indexer_compress_ratio "
                         f"{config.indexer_compress_ratio}")
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters rope_type {rope['rope_type']!r} is not supported; only 'default'")
    if set(rope) - _ROPE_KEYS:
        raise ValueError(f"rope_parameters {sorted(set(rope) - _ROPE_KEYS)} are not supported")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
    if config.hc_count < 2:
        raise ValueError(f"hc_count is {config.hc_count}; Qwen4-Exp's hyper-connections need at least 2 streams")
    ple = list(config.ple_layer_ids or [])
    if ple:
        heads = (config.ngram_size - 1) * config.heads_per_ngram
        if heads <= 0 or config.ple_embed_dim % heads:
            raise ValueError(f"ple_embed_dim {config.ple_embed_dim} is not a multiple of the n-gram heads {heads}")
        wrong = [i for i in ple if not 1 <= i <= config.num_hidden_layers
                 or config.layer_types[i - 1] != "linear_attention"]
        if wrong:
            raise ValueError(f"ple_layer_ids {wrong} are not (one-indexed) linear_attention layers")
        if config.eos_token_id is None or config.eos_token_id == []:
            raise ValueError("eos_token_id must be set for PLE layers (their n-gram shifts stop at it)")
