"""Megatron-style sharding of the decoder family (Qwen3, Qwen3-MoE, Llama, Mistral) over a tensor-parallel
group, as vLLM shards them:

- q/k/v column-parallel by heads; with fewer KV heads than ranks each KV head is replicated and rank r uses
  head r // (tp / num_kv_heads); o_proj row-parallel, then one all-reduce.
- gate/up column-parallel, down row-parallel, then one all-reduce; MoE experts sharded on their intermediate
  dimension the same way, one all-reduce per MoE block (the router is replicated, so every rank routes alike).
- the embedding vocab-parallel (each rank looks up its rows, zeros elsewhere, all-reduce) and the LM head
  vocab-parallel, its logits gathered on rank 0, which samples.

Sharding rewrites the model built on the meta device and returns, for each checkpoint tensor, the part this
rank loads (ladle.models.loading.loader reads only that slice from the safetensors file).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ladle.distributed.parallel_state import TensorParallel
from ladle.models.layers.decoder_layer import Attention, GatedMLP, StackedLinear
from ladle.models.layers.moe import FusedMoE, SharedExpertMoeBlock, SparseMoeBlock


@dataclass(frozen=True)
class Slice:
    """The rows (dim 0) or columns (dim 1) [start, start + size) of a checkpoint tensor."""

    dim: int
    start: int
    size: int


# Checkpoint tensor name -> the slice this rank loads, or None for a tensor this rank does not load (a
# row-parallel bias lives on rank 0 only, so the all-reduce adds it once). Names not listed load whole.
Slices = dict[str, Slice | None]


def divide(n: int, tp: TensorParallel, what: str) -> int:
    if n % tp.world_size:
        raise ValueError(f"{what} = {n} is not divisible by tensor_parallel_size {tp.world_size}; choose a "
                         "tensor_parallel_size that divides it")
    return n // tp.world_size


def kv_heads_of_rank(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, number of KV heads) rank tp.rank keeps: a share of them, or one replicated head."""
    if num_kv_heads >= tp.world_size:
        count = divide(num_kv_heads, tp, "num_key_value_heads")
        return tp.rank * count, count
    if tp.world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.world_size} is neither a divisor nor a multiple of "
                         f"num_key_value_heads = {num_kv_heads}; choose one that is")
    return tp.rank // (tp.world_size // num_kv_heads), 1


def _rows(names: list[str], start: int, size: int) -> Slices:
    return {n: Slice(0, start, size) for n in names}


def _row_parallel(prefix: str, linear: nn.Linear, in_size: int, tp: TensorParallel) -> tuple[nn.Linear, Slices]:
    """A row-parallel replacement for linear: this rank's in_size input columns; the bias on rank 0 only."""
    has_bias = linear.bias is not None
    layer = nn.Linear(in_size, linear.out_features, bias=has_bias and tp.is_driver)
    slices: Slices = {f"{prefix}.weight": Slice(1, tp.rank * in_size, in_size)}
    if has_bias and not tp.is_driver:
        slices[f"{prefix}.bias"] = None
    return layer, slices


def shard_attention(attn: Attention, prefix: str, tp: TensorParallel) -> Slices:
    heads = divide(attn.num_heads, tp, "num_attention_heads")
    kv_start, kv = kv_heads_of_rank(attn.num_kv_heads, tp)
    hd, hidden = attn.head_dim, attn.o_proj.out_features
    bias = attn.qkv_proj.bias is not None
    attn.num_heads, attn.num_kv_heads, attn.sizes = heads, kv, (heads * hd, kv * hd, kv * hd)
    attn.qkv_proj = StackedLinear(hidden, {"q_proj": heads * hd, "k_proj": kv * hd, "v_proj": kv * hd}, bias)
    attn.o_proj, slices = _row_parallel(f"{prefix}.o_proj", attn.o_proj, heads * hd, tp)
    attn.tp = tp
    kinds = ["weight", "bias"] if bias else ["weight"]
    slices.update(_rows([f"{prefix}.q_proj.{k}" for k in kinds], tp.rank * heads * hd, heads * hd))
    slices.update(_rows([f"{prefix}.{p}.{k}" for p in ("k_proj", "v_proj") for k in kinds], kv_start * hd, kv * hd))
    return slices


def shard_mlp(mlp: GatedMLP, prefix: str, tp: TensorParallel) -> Slices:
    size = divide(mlp.down_proj.in_features, tp, "intermediate_size")
    hidden = mlp.down_proj.out_features
    bias = mlp.gate_up_proj.bias is not None
    mlp.gate_up_proj = StackedLinear(hidden, {"gate_proj": size, "up_proj": size}, bias)
    mlp.down_proj, slices = _row_parallel(f"{prefix}.down_proj", mlp.down_proj, size, tp)
    mlp.tp = tp
    kinds = ["weight", "bias"] if bias else ["weight"]
    slices.update(_rows([f"{prefix}.{p}.{k}" for p in ("gate_proj", "up_proj") for k in kinds], tp.rank * size,
                        size))
    return slices


def shard_experts(block: SparseMoeBlock, prefix: str, tp: TensorParallel) -> Slices:
    experts: FusedMoE = block.experts
    size = divide(experts.intermediate_size, tp, "moe_intermediate_size")
    num, hidden = experts.num_experts, experts.w2.shape[1]
    experts.intermediate_size = size
    experts.w13 = nn.Parameter(torch.empty(num, 2 * size, hidden))
    experts.w2 = nn.Parameter(torch.empty(num, hidden, size))
    block.tp = tp
    gate, up, down = experts.names
    slices: Slices = {}
    for j in range(num):
        base = f"{prefix}.experts.{j}"
        slices.update(_rows([f"{base}.{gate}.weight", f"{base}.{up}.weight"], tp.rank * size, size))
        slices[f"{base}.{down}.weight"] = Slice(1, tp.rank * size, size)
    return slices


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; a token outside them contributes zeros, and
    the all-reduce fills in every token from the rank that holds it."""

    def __init__(self, rows: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.tp = tp.rank * rows, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class ShardedDecoder(Protocol):
    """What shard_decoder reads and replaces of a DecoderForCausalLM (said by its shape: ladle.models.decoder
    imports this file)."""

    config: Any
    tp: TensorParallel

    @property
    def model(self) -> nn.Module: ...

    @property
    def lm_head(self) -> nn.Module | None: ...

    @lm_head.setter
    def lm_head(self, value: nn.Linear) -> None: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def shard_decoder(model: ShardedDecoder, tp: TensorParallel) -> Slices:
    """Shard a DecoderForCausalLM (built on meta) in place for rank tp.rank; returns what it loads."""
    slices: Slices = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, SharedExpertMoeBlock):
            raise ValueError("tensor parallelism does not cover shared-expert MoE blocks yet")
        if isinstance(module, Attention):
            slices.update(shard_attention(module, name, tp))
        elif isinstance(module, GatedMLP):
            slices.update(shard_mlp(module, name, tp))
        elif isinstance(module, SparseMoeBlock):
            slices.update(shard_experts(module, name, tp))
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    rows = divide(vocab, tp, "vocab_size")
    model.model.embed_tokens = VocabParallelEmbedding(rows, hidden, tp)
    slices.update(_rows(["model.embed_tokens.weight", "lm_head.weight"], tp.rank * rows, rows))
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, rows, bias=False)
    model.tp = tp
    return slices
