"""A GGUF file's tensors under HF names: the names llama.cpp gave them mapped back, every expected tensor present
with its shape, and llama's Q/K rows put back in HF's order.

llama.cpp's converter permutes the rows of llama's q_proj and k_proj (convert_hf_to_gguf.py, LlamaModel.permute)
so its rope rotates adjacent pairs (GPT-J style) where HF rotates the two halves of each head. ladle's rope is
HF's, so the rows go back: within each head, row 2i+j of the file is row j*half+i of HF's. That is a permutation
of whole rows, so it applies as well to a quantized tensor's block rows as to widened values (the quantized
path keeps the blocks and permutes them the same way). Qwen2 and Qwen3 use NEOX-style rope in llama.cpp and are
stored unpermuted.

A MoE layer's experts are one stacked tensor per projection in the file (blk.N.ffn_{gate,up,down}_exps.weight,
[experts, out, in] in torch order); each expert's slice maps to its HF per-expert name
(model.layers.N.mlp.experts.J.gate_proj.weight, ...), which ladle's FusedMoE stacks again at load, and is read
and widened alone, so host memory holds one expert beyond the model. Experts are always widened to the model
dtype: keeping them as blocks needs a grouped block kernel (the dense GgmlLinear runs one matrix), not written
yet; the attention linears of a MoE file stay blocks as in a dense one.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ladle.gguf.reader import GGUFFile, TensorInfo

# blk.N.<gguf name> -> model.layers.N.<HF name>, per architecture (biases follow the same names).
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# blk.N.<gguf name>, stacked [experts, out, in] -> model.layers.N.mlp.experts.J.<HF name> for each expert J.
_EXPERT_NAMES: Mapping[str, str] = MappingProxyType({
    "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
})
_DENSE = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
          "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "llama": _DENSE,
    "qwen2": _DENSE + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": _DENSE + ("attn_q_norm.weight", "attn_k_norm.weight"),
    # llama_model_qwen3moe::load_arch_tensors: qwen3's attention, every layer a router and three expert stacks
    "qwen3moe": ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
                 "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"),
}
# Architectures whose Q/K rows llama.cpp's converter permuted for GPT-J-style rope.
_PERMUTED_QK = frozenset({"llama"})


class GGUFTensorError(ValueError):
    """A tensor is missing, unexpected, or of the wrong shape for the config."""


@dataclass(frozen=True)
class MappedTensor:
    """One file tensor (or one expert of a stacked one) under its HF name, with the row order HF expects
    (None: the file's order)."""
    hf_name: str
    info: TensorInfo
    rows: torch.Tensor | None
    expert: int | None = None  # the index into a stacked experts tensor's first dimension


def hf_name_of(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name (None for a name this mapping does not know, and for
    a stacked experts tensor, which is many HF tensors: expert_names_of)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def expert_names_of(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF per-expert names of a stacked experts tensor, by expert (None for any other name)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERT_NAMES:
        return [f"model.layers.{parts[1]}.mlp.experts.{j}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
                for j in range(num_experts)]
    return None


def expected_shapes(arch: str, config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor the file must hold for config, by llama.cpp name, with its HF (torch-order) shape."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden),
                 "attn_v.weight": (kv, hidden), "attn_output.weight": (hidden, q), "ffn_norm.weight": (hidden,),
                 "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
                 "ffn_down.weight": (hidden, inter), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                 "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    experts = getattr(config, "num_experts", None)
    if experts:
        expert_inter = config.moe_intermediate_size
        per_layer.update({"ffn_gate_inp.weight": (experts, hidden),
                          "ffn_gate_exps.weight": (experts, expert_inter, hidden),
                          "ffn_up_exps.weight": (experts, expert_inter, hidden),
                          "ffn_down_exps.weight": (experts, hidden, expert_inter)})
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        for name in _LAYER_TENSORS[arch]:
            shapes[f"blk.{i}.{name}"] = per_layer[name]
    return shapes


def map_tensors(gguf: GGUFFile, arch: str, config: Any) -> list[MappedTensor]:
    """The file's tensors in file order under HF names; raises naming a missing, unexpected or misshapen one."""
    shapes = expected_shapes(arch, config)
    missing = [n for n in shapes if n not in gguf.tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise GGUFTensorError(f"{gguf.path}: the file lacks tensors the config needs: {shown}")
    mapped: list[MappedTensor] = []
    for name, info in gguf.tensors.items():
        if name not in shapes:
            raise GGUFTensorError(f"{gguf.path}: tensor {name!r} is not one ladle's {arch} model has; the file "
                                  "describes a model ladle would not run as written")
        if info.shape != shapes[name]:
            raise GGUFTensorError(f"{gguf.path}: tensor {name!r} has shape {list(info.shape)} where the metadata "
                                  f"implies {list(shapes[name])}")
        rows = None
        if arch in _PERMUTED_QK and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            rows = unpermute_rows(info.shape[0], heads)
        experts = expert_names_of(name, info.shape[0])
        if experts is not None:
            mapped.extend(MappedTensor(hf, info, None, j) for j, hf in enumerate(experts))
        else:
            hf_name = hf_name_of(name)
            assert hf_name is not None  # expected_shapes names only tensors the mapping knows
            mapped.append(MappedTensor(hf_name, info, rows))
    return mapped


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """HF row r of a llama.cpp-permuted Q or K weight is file row index[r]: within each head of d rows, the file
    interleaves the two rope halves (file row 2i+j holds HF row j*d/2+i)."""
    half = num_rows // num_heads // 2
    # file order viewed as [head, i, j]; HF order is [head, j, i]
    file_rows = torch.arange(num_rows).view(num_heads, half, 2)
    return file_rows.transpose(1, 2).reshape(num_rows)


def widened(gguf: GGUFFile, tensor: MappedTensor, raw: np.ndarray | None = None) -> torch.Tensor:
    """The tensor dequantized to float32 (gguf.quants.dequantize: llama.cpp's block formats in numpy), rows in
    HF order. raw: the file tensor's mapping, where the caller holds it already (the experts of one stack)."""
    from gguf.quants import dequantize

    values = np.ascontiguousarray(dequantize(_part(gguf, tensor, raw), tensor.info.qtype), dtype=np.float32)
    if not values.flags.writeable:  # an F32 tensor comes back as the read-only file mapping itself
        values = values.copy()
    out = torch.from_numpy(values)
    return out if tensor.rows is None else out.index_select(0, tensor.rows)


def blocks(gguf: GGUFFile, tensor: MappedTensor, raw: np.ndarray | None = None) -> torch.Tensor:
    """The tensor's bytes as the file holds them, [rows, row bytes] uint8, rows in HF order (a copy: the file
    stays mapped read-only)."""
    raw = _part(gguf, tensor, raw)
    values = torch.from_numpy(np.array(raw.reshape(raw.shape[0], -1), dtype=np.uint8))
    return values if tensor.rows is None else values.index_select(0, tensor.rows)


def _part(gguf: GGUFFile, tensor: MappedTensor, raw: np.ndarray | None) -> np.ndarray:
    """The file bytes (or elements) of tensor: the whole file tensor, or its expert's slice of a stack."""
    raw = gguf.raw(tensor.info) if raw is None else raw
    return raw if tensor.expert is None else raw[tensor.expert]


def iter_weights(gguf: GGUFFile, tensors: list[MappedTensor],
                 keep: frozenset[str] | set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time, so host memory holds one tensor (one expert of a stack) beyond the
    model: the block bytes of the names in keep (layers that stay quantized), every other tensor widened to
    float32."""
    held: tuple[TensorInfo, np.ndarray] | None = None  # a stack's experts follow one another: map it once
    for tensor in tensors:
        if held is None or held[0] is not tensor.info:
            held = (tensor.info, gguf.raw(tensor.info))
        take = blocks if tensor.hf_name in keep else widened
        yield tensor.hf_name, take(gguf, tensor, held[1])
