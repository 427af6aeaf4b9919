"""Tiny GGUF files written as llama.cpp's converter writes them: a random-weight HF model (ladle.demo's
tokenizer, transformers' from_config) through gguf's GGUFWriter, 2-D weights quantized with gguf.quants.

The same HF config, names, Q/K row permutation (llama) and metadata keys as convert_hf_to_gguf.py, so a file
here loads in transformers (gguf_file=, the tests' oracle) and in ladle alike. A Qwen3-MoE's experts go out as
the converter writes them (conversion/qwen.py, Qwen2MoeModel.modify_tensors): transformers' stacked
gate_up_proj [E, 2I, H] split into ffn_gate_exps and ffn_up_exps, down_proj as ffn_down_exps, and the router
(ffn_gate_inp) kept F32 in every file type, as the converter keeps it. `extra_keys` and `drop` make the
bad files the tests need (an unknown key, a missing tensor).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# ggml quantization name -> written for 2-D weights (1-D norms and biases stay F32, as llama.cpp keeps them).
QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
# Weights the converter writes F32 whatever the file type, as it does 1-D tensors: the MoE router.
_ALWAYS_F32 = ("ffn_gate_inp.weight",)


def tiny_hf_model(arch: str, seed: int = 0, **config: Any) -> tuple[Any, Any]:
    """(model, tokenizer): a random-weight fp32 HF model of arch (llama, qwen2, qwen3, qwen3_moe) and ladle's
    ChatML byte-level BPE. Qwen3 keeps head_dim 128: transformers' GGUF loader never reads its
    attention.key_length and leaves Qwen3Config's default, so the oracle loads only files with that head size.
    Its qwen3_moe loader does read key_length (head_dim 16 here), but not expert_feed_forward_length: the oracle
    passes moe_intermediate_size itself. Qwen3-MoE: 8 experts, top 2, renormalised (llama.cpp's qwen3moe always
    renormalises), every layer sparse (llama.cpp's has no dense layers), untied head as in Qwen3-30B-A3B."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ladle.demo import DEFAULT_INIT_RANGE, ENDOFTEXT, IM_END, build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(tmp, vocab_size=512)
    shape: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=2048, rms_norm_eps=1e-6)
    if arch == "qwen3":  # tied, as Qwen3's small models are: the file has no output.weight
        shape.update(num_attention_heads=2, num_key_value_heads=1, head_dim=128, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        shape.update(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    shape.update(config)
    hf_config = AutoConfig.for_model(arch, vocab_size=len(tok), initializer_range=DEFAULT_INIT_RANGE,
                                     bos_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
                                     eos_token_id=tok.convert_tokens_to_ids(IM_END),
                                     pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT), **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        if arch == "qwen2":  # HF initialises biases to zero; random ones check they are loaded and added
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.data.normal_(0.0, DEFAULT_INIT_RANGE)
    return model.eval(), tok


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation (LlamaModel.permute): each head's two rope halves interleaved."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model: Any, tokenizer: Any, path: str | Path, arch: str, qtype: str = "F32",
               extra_keys: dict[str, Any] | None = None, drop: tuple[str, ...] = (), pre: str = "default") -> Path:
    """Write model and tokenizer as a GGUF file (2-D weights in qtype); returns the path."""
    import gguf
    from gguf.quants import quantize

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    if arch == "qwen3moe":  # TextModel.set_gguf_parameters and Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "qwen3moe"):  # their HF configs set head_dim, which the converter writes
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(w, tokenizer, pre)
    for key, value in (extra_keys or {}).items():
        w.add_key_value(key, value[0], value[1])
    target = gguf.GGMLQuantizationType[qtype]
    for name, values in _converted(model, arch):
        out_name = gguf_name(name)
        if out_name in drop:
            continue
        if values.ndim == 1 or target == gguf.GGMLQuantizationType.F32 or out_name.endswith(_ALWAYS_F32):
            w.add_tensor(out_name, np.ascontiguousarray(values, dtype=np.float32))
        elif target == gguf.GGMLQuantizationType.F16:
            w.add_tensor(out_name, values.astype(np.float16))
        else:
            w.add_tensor(out_name, quantize(np.ascontiguousarray(values), target), raw_dtype=target)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _converted(model: Any, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 numpy values) as the converter sees them: the tied head dropped, llama's Q/K rows
    permuted, transformers' expert stacks named as the converter's merged ones (mlp.experts.gate_proj.weight),
    gate_up_proj split into gate and up."""
    cfg = model.config
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = permute_qk(values, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            half = values.shape[1] // 2
            yield name.replace("gate_up_proj", "gate_proj.weight"), np.ascontiguousarray(values[:, :half])
            yield name.replace("gate_up_proj", "up_proj.weight"), np.ascontiguousarray(values[:, half:])
            continue
        yield name + (".weight" if name.endswith("mlp.experts.down_proj") else ""), values


def _write_tokenizer(w: Any, tokenizer: Any, pre: str) -> None:
    """As convert_hf_to_gguf.py writes a byte-level BPE: tokens by id, types (3 control for special tokens),
    merges as 'a b', the special ids and the chat template."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    for token, add in ((tokenizer.bos_token, w.add_bos_token_id), (tokenizer.eos_token, w.add_eos_token_id),
                       (tokenizer.pad_token, w.add_pad_token_id)):
        if token is not None:
            add(vocab[token])
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
