"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention, and a sparse MoE MLP in the layers the config picks."""
from __future__ import annotations

from typing import Any

from torch import nn

from ladle.models.decoder import DecoderForCausalLM, dense_mlp
from ladle.models.layers.moe import SparseMoeBlock


def is_sparse(config: Any, layer_idx: int) -> bool:
    """HF's rule: every decoder_sparse_step-th layer is sparse, except those listed in mlp_only_layers."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = True

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config) if is_sparse(config, layer_idx) else dense_mlp(config, layer_idx)
